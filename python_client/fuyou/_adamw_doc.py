"""The reference documentation of fuyou.AdamW (its docstring): chunking,
overlap, speculation and redo, accumulation, mixed precision, loss scaling,
clipping, state dicts, forking, the streamed mode, export and import, and the
constructor's arguments. Kept apart from optimizer.py so that the code reads
in one sitting; ``AdamW.__doc__`` is this text."""

__all__ = ["ADAMW_REFERENCE"]

ADAMW_REFERENCE = r"""AdamW whose fp32 master weights and moments live in fuyoud (DRAM and NVMe).

    Use it like ``torch.optim.AdamW``::

        opt = fuyou.AdamW(model.parameters(), lr=1e-4, job="gpt-ft")
        for batch in data:
            loss = model(batch).loss
            loss.backward()        # chunks are updated by the daemon during backward
            opt.step()             # waits for what has not arrived, then commits
            opt.zero_grad()

    **Chunks.** The trainable parameters (``requires_grad``; frozen ones are
    left alone unless ``track_frozen``, tied ones counted once) are packed into
    chunks of at most ``chunk_bytes`` bytes of weights, in reverse order of each
    parameter group;
    chunks never mix groups, dtypes or devices. Ids derive from the group index
    and position, so a job that is opened again (same ``job``, same model, same
    ``chunk_bytes``) resumes the same chunks: the daemon's weights then replace
    the model's (``resumed`` is True) and training continues after
    ``committed_step``.

    **Overlap.** With ``overlap=True`` a hook on each parameter's gradient
    accumulator notices when every gradient of a chunk is in and only enqueues
    the chunk; the optimizer's sender thread copies its gradients (one copy; on
    CUDA on a side stream into pinned memory) into a shared-memory slot and the
    daemon updates it while backward goes on with earlier layers. When all
    ``num_slots`` slots are busy the sender thread (never backward) waits for the
    oldest chunk's new weights and keeps them in a per-chunk staging copy (extra
    memory of that chunk's size, on the parameters' device); the model's
    parameters themselves only change in :meth:`step`, after
    backward. Each GradReady carries the group's *current* ``lr``, ``betas``,
    ``eps`` and ``weight_decay``, so LR schedulers work as with torch.

    **Speculate, validate, redo.** An update sent during backward is
    *speculative*: with it goes a fingerprint of the chunk's gradients (sum
    and sum of squares, computed on the gradients' device). :meth:`step` takes the
    fingerprints of the sent chunks again from the current ``.grad`` (one pass,
    one wait for the device) and redoes every chunk whose gradients changed
    (``clip_grad_norm_``, an in-place unscale, one more backward): the daemon
    drops its update of the step and updates again from the committed states.
    The result is what torch.optim.AdamW computes from ``.grad`` at step(). A
    step the loop skips (:meth:`zero_grad`, or the model's ``zero_grad`` and a new
    backward, without :meth:`step`) is rolled back (AbortStep): nothing of it is
    committed. ``loop_stats`` counts all of this.

    **Gradient accumulation.** Nothing to do: a backward pass that reaches a
    chunk already sent in the step (with a gradient that is not zero) tells
    fuyou that the loop accumulates. That step's early updates are redone at
    :meth:`step`; from then on a chunk is sent after as many passes as the loop
    made (``accumulation_steps=k`` says so from the start). A :meth:`step` that
    comes earlier sends what has accumulated.

    **Mixed precision.** bf16/fp16 parameters travel as such (weights and
    gradients in the parameter's dtype); the daemon keeps fp32 masters and
    returns weights rounded to the parameter's dtype. ``loss_scale`` (a number,
    or ``"dynamic"``: 2**16, x2 after 2000 good steps, x0.5 at an overflow) asks
    you to backpropagate ``opt.scale_loss(loss)``; gradients are unscaled in the
    daemon (``grad_scale = 1/scale``). Cost: every chunk's gradients are checked
    for inf/nan before they are sent (one extra pass over the gradients), and an
    overflow found in any chunk skips the whole step: an ``AbortStep`` rolls back
    the chunks the daemon already updated in that step (their updates were wasted
    work), no weights are installed, the scale is lowered and ``skipped_steps``
    grows.

    **Clipping.** ``max_grad_norm`` clips by the global gradient norm exactly as
    ``torch.nn.utils.clip_grad_norm_`` (then AdamW), with overlap on: chunks are
    updated speculatively during backward; at :meth:`step` the per-chunk sums of
    squares give the global norm, and when the coefficient
    ``max_norm / (norm + 1e-6)`` is below 1 every chunk is redone with
    ``grad_scale = clip_coef / loss_scale`` (``.grad`` is not rewritten). Cost:
    a step that clips takes backward plus one optimizer pass over all chunks (as
    without overlap), one that does not clips nothing. A non-finite norm skips
    the step like an overflow. ``clip_grad_norm_`` in the loop works as well
    (every chunk it scales is redone as changed).

    **Parameters without a gradient.** A parameter whose ``.grad`` is None in a
    step keeps its weights, moments and Adam step count, as in torch, even when
    its chunk holds parameters with gradients (the GradReady names the chunk's
    segments without one). A chunk in which no parameter has a gradient is not
    sent at all.

    **state_dict.** :meth:`state_dict` is torch's, with each parameter's ``step``,
    ``exp_avg`` and ``exp_avg_sq`` read from the daemon (up to
    ``state_dict_max_bytes`` of moments), so ``torch.optim.AdamW`` continues from
    it; :meth:`load_state_dict` imports torch's (or another step's) moments into
    the daemon. ``opt.state[p]`` reads the daemon's states of ``p`` (read-only).

    **load_state_dict from another job.** A state dict that :meth:`state_dict`
    took from an optimizer on another job *forks* that job into this one, as
    torch's copy of the moments does, when this optimizer's job has nothing
    trained yet (a new job): its weights, moments and step counts become those of
    the other job at its last commit, and the parameters get its weights. The
    states are copied inside the daemon (admin ``CopyJob``, as ``fuyouctl
    copy-job``) when no session has the other job open, or read through the two
    sessions when an optimizer of this process has it open. Both optimizers then
    train identically. The layouts must match (same model, groups and
    ``chunk_bytes``); a job that already has trained states keeps them (a warning
    says so).

    **Weights in the daemon (offload_params=True).** For a model larger than
    the GPU: the daemon keeps each chunk's working weights too (in the
    parameters' dtype, beside master, m and v, under the same DRAM budget and
    commits) and the model holds them only while a module runs. The
    constructor opens the session and registers nothing (the parameters may be
    on ``meta``); :func:`fuyou.stream_parameters` plans the chunks from the
    model's modules (``offload.bind``: a chunk never holds two modules'
    parameters), registers the modules not registered yet (their current
    values start a new job; a resumed job keeps the daemon's committed weights)
    and installs the hooks that fetch each module's weights for its forward and
    backward. ``offload`` is the :class:`fuyou._offload.OffloadedParams` of the
    model (``bind``, ``job_exists``, ``register_module``, ``registered``; None
    without offload_params); ``fuyou.materialize`` registers one module at a
    time through it. A chunk's gradients go to the daemon as soon as backward
    completes them and are freed then, and the new weights are not installed
    (the next forward fetches them). The daemon journals the step's gradients
    and ``.grad`` becomes a :class:`fuyou._freed_grad.FreedGrad`: norms, inf
    checks, ``mul_``/``div_``/``zero_`` work (``clip_grad_norm_``, GradScaler,
    ``zero_grad``) and are replayed on the journal at :meth:`step`; a pass into
    a chunk already sent (undeclared accumulation) adds into the journal.
    ``max_grad_norm=`` replays every chunk with the coefficient, keeping the
    overlap. ``accumulation_steps=k`` adds each pass's gradients into a host
    copy and sends at the k-th. Not with ``init_from`` nor ``load_state_dict``
    of another job. It takes
    ``FETCH_SLOTS`` (4) more slots of ``chunk_bytes`` for the fetches.

    **Export and import.** :meth:`export_checkpoint` writes the job's weights and
    a ``torch.optim.AdamW``-compatible optimizer state (``step``, ``exp_avg``,
    ``exp_avg_sq`` per parameter) to a PyTorch checkpoint. ``init_from`` (a
    path, such a checkpoint dict, or a plain ``torch.optim.AdamW.state_dict()``
    of the same parameter groups) starts a *new* job from it: the master weights
    come from the model's parameters (load the checkpoint's weights into the
    model first, as with torch), or from an export whose ``model`` is keyed by
    parameter index; moments and step counts from the optimizer state; the
    groups' ``lr``, ``betas``, ``eps`` and ``weight_decay`` are taken over as
    ``load_state_dict`` does. The checkpoint is checked (group sizes, shapes)
    before anything is sent to the daemon, and the import commits atomically.

    Args:
        job: name of the job on the daemon (1-64 of ``[A-Za-z0-9._-]``). May be
            left out for parameters built in ``fuyou.init_empty(job=...)``,
            which recorded it.
        address: gRPC target of fuyoud (``unix:/path`` or a socket path). None:
            the default socket (``$FUYOU_SOCKET``, ``/run/fuyou/fuyoud.sock``, or
            the per-user one); when nothing answers there and ``embedded`` is not
            False (nor ``$FUYOU_EMBEDDED=0``) a private fuyoud is started for this
            process (see :class:`fuyou.EmbeddedDaemon`); ``embedded=True`` uses
            it even when a fuyoud answers on the default socket. The optimizers of
            one process share that embedded fuyoud (reference-counted: the last
            one closed stops it), each on its own job. A daemon on a default
            socket (not named by ``$FUYOU_SOCKET``) must run as you, root or the
            ``fuyou`` user, checked on the very connection the session uses:
            :class:`fuyou.UntrustedDaemon` otherwise, with nothing sent.

    **Exit without close().** At interpreter exit every optimizer still open is
    closed as :meth:`close` does (the steps that :meth:`step` returned from are
    committed; a step in progress, i.e. backward done without :meth:`step`, is
    abandoned), before the embedded daemon is stopped, so the daemon stops at once
    (no drain of an open session). A job reopened later resumes at the last step
    that :meth:`step` returned from.
        chunk_bytes: most bytes of weights in one chunk (slot size).
        num_slots: shared-memory slots, i.e. chunks in flight at once (1-64).
        amsgrad: must be False (NotImplementedError otherwise: the daemon keeps
            no running maximum of ``exp_avg_sq``).
        maximize: as torch: maximizes the objective (Adam on ``-grad``; sent to the
            daemon as a negative ``grad_scale``). Per parameter group.
        foreach, capturable, differentiable, fused: accepted for compatibility
            with torch.optim.AdamW and kept in the parameter groups; they choose
            torch's implementation of the update and have no effect here (the
            daemon runs its own CPU kernel; gradients are not differentiated
            through the step).
        timeout: seconds any wait on the daemon may take before
            :class:`fuyou.FuyouError` is raised (a dead daemon never hangs a job).
        init_from: checkpoint to start a new job from (see above).
        offload_params: keep the working weights in the daemon and stream them
            into the model (see above and :func:`fuyou.stream_parameters`).
        state_dtype: ``"fp32"`` (default), ``"bf16"`` or ``"8bit"`` (also
            spelled ``"int8"``): the dtype the daemon
            keeps ``exp_avg`` and ``exp_avg_sq`` in (the master weights stay fp32).
            bf16 takes 8 bytes a parameter on the SSDs instead of 12, a third
            less to read and write per step; ``m`` is rounded to nearest even,
            ``v`` stochastically (unbiased; nearest rounding would stop ``v``
            from decaying). The kernel computes in fp32. Fixed when the job is
            created: a resume with the other is :class:`fuyou.FailedPrecondition`
            naming the job's. :meth:`state_dict` still gives fp32 tensors; a
            loaded (or ``init_from``) fp32 state is rounded. Not for: runs that
            need fp32 moments bit for bit (comparisons with torch, debugging),
            beta2 above ~0.9999 or tiny learning rates where v's 8-bit mantissa
            (relative error 2^-9 a value) matters, or a DRAM-bound job (the
            saving is in SSD bytes; see the README). ``"8bit"`` keeps about 6
            bytes a parameter (half of fp32): ``m`` and ``v`` as 8-bit codes
            with an fp32 scale per block of 256 elements (``m``: sign, 4-bit
            exponent, 3-bit mantissa, to nearest; ``v``: 4-bit exponent, 4-bit
            mantissa, stochastically, never rounded to zero), decoded, updated
            in fp32 and encoded again in one pass. Each ``m`` is within 1/16 of
            itself and each ``v`` within 1/16 (stochastic: unbiased), or below
            2^-16 of its block's largest (``m`` stored as 0, ``v`` as the
            smallest code); a NaN or inf gradient makes its whole block NaN.
            Not for: what bf16 is not for, nor parameters whose gradients
            span more than ~2 decades within 256 neighbours (blocks may span
            two parameters of a chunk), nor a model whose states fit the DRAM
            budget (see the README).
        state_dict_max_bytes: most bytes of moments (fp32 exp_avg + exp_avg_sq)
            :meth:`state_dict` puts in ``state`` (2 GiB; None: no limit); above
            it the state dict holds a job reference only and a warning names
            :meth:`export_checkpoint`. Also an attribute, settable.
        process_group: the torch.distributed group of a data-parallel job
            (None: the default group when torch.distributed is initialised
            with more than one rank). Each rank trains the job
            ``<job>.rank<r>-of<w>`` on one fuyoud per node and owns whole
            chunks; each chunk is averaged over the ranks during backward and
            ``.grad`` holds the average after it, as under DDP; see README
            "Data parallel", ``_data_parallel.py`` and ``_dp_overlap.py``.
            There :meth:`state_dict`, :meth:`load_state_dict` and
            :meth:`export_checkpoint` are collectives over the whole job (call
            them on every rank; _sharded_states.py), ``opt.state`` is the
            rank's own, and ``offload_params`` keeps a copy of every chunk in
            each rank's job (_sharded_streamed.py).
            False: a single-process optimizer on ``job`` although
            torch.distributed is initialised (a rank's own model, say).
        track_frozen: also register the parameters that are frozen
            (``requires_grad=False``) when the optimizer is built, in chunks
            of their own, so that unfreezing one later (gradual unfreezing)
            trains it as torch does: from its first gradient, with fresh
            moments. They cost their states on the SSD (12 bytes a
            parameter) and one write at construction, nothing a step while
            frozen. Off (the default) a frozen parameter costs nothing (a
            LoRA's frozen base passed with ``model.parameters()``), and one
            unfrozen later is refused at :meth:`step`. With
            ``offload_params``: the frozen parameters' weights live in fuyoud
            too and stream in with their modules, read-only (a LoRA's frozen
            base larger than the GPU): never sent, never updated, nothing of
            them written per step; one unfrozen later is refused at
            :meth:`step`. One process only (else NotImplementedError).
    """
