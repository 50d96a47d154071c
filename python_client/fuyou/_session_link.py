"""SessionLink: a pipeline's session to fuyoud and the job's steps as the
daemon last answered them (applied, durable).

The pipeline attaches a session, asks the link which step is next, and ends
or abandons that step through it, or waits for the applied step to be durable,
or sets a new job's step (a reshard's import); nothing else changes the two
counts."""

from __future__ import annotations

__all__ = ["SessionLink"]


class SessionLink:
    """One session (a fuyou._fuyou.Session or a fake) at a time, or none."""

    def __init__(self):
        self.session = None
        self.committed = 0  # last step the daemon applied (EndStep answered)
        self.durable = 0  # last step it reported durable: what a crash keeps

    def attach(self, session) -> None:
        """Takes `session`; both counts start at its committed step."""
        self.session = session
        self.committed = self.durable = int(session.committed_step)

    def detach(self):
        """Forgets the session (returned; None when there was none)."""
        session, self.session = self.session, None
        return session

    @property
    def next_step(self) -> int:
        """The step in progress: the one after the last applied."""
        return self.committed + 1

    def end_step(self) -> None:
        """EndStep of the step in progress; takes the daemon's counts."""
        committed, _chunks, durable = self.session.end_step(self.next_step)
        self.committed = int(committed)
        self.durable = int(durable)

    def wait_durable(self) -> None:
        """Waits until the last applied step is durable (WaitDurable) and takes
        the daemon's durable step; sends nothing when it was reported durable."""
        if self.durable >= self.committed:
            return
        self.durable = int(self.session.wait_durable(self.committed))

    def commit_import_at(self, step: int) -> None:
        """CommitImport with ``resume_step=step``: the job, which committed no
        step yet, is at `step` (durable: an import commits durably)."""
        self.session.commit_import(resume_step=step)
        self.committed = self.durable = int(self.session.committed_step)

    def abort_step(self, **reason) -> None:
        """AbortStep of the step in progress (`reason=`: fuyou.v1.AbortReason)."""
        self.session.abort_step(self.next_step, **reason)
