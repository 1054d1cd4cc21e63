"""The worker engine on the real test model and a real SQLite store: rows done once, redelivery
skips done rows, one bad row never sinks its chunk, cancel and the attempts cap end the run."""

from __future__ import annotations

import pytest
import torch
from sqlalchemy import func, select

from canvasq.core.schemas import Job
from canvasq.core.tables import ForwardTraceRow, Output
from canvasq.worker.engine import Engine

PROMPTS = [
    ("math", "Ann has 12 apples. She finds 3 more apples. How many apples does Ann have now?"),
    ("code", 'def f_1(xs):\n    """Return the sum of xs.\n    >>> f_1([1, 2])\n    3\n    """\n'),
]


def jobs(n: int, max_tokens: int = 32) -> list[Job]:
    return [Job(f"r{i}", PROMPTS[i % 2][1], PROMPTS[i % 2][0], max_tokens, None, i + 1) for i in range(n)]


def engine_for(wsettings, wstore, bundle, **kw) -> Engine:
    return Engine(settings=wsettings, store=wstore, bundle=bundle, worker_id="test:1", queue="q", **kw)


def test_chunk_done_once_and_redelivery_writes_nothing(wsettings, wstore, bundle):
    run = wstore.create_run(jobs(5), model=wsettings.model, queue="q", decoder="official", chunk_size=5)
    engine = engine_for(wsettings, wstore, bundle)
    first = engine.process_chunk(run.chunk_ids[0])
    assert first.state == "work" and first.written == 5
    assert wstore.run_status(run.run_id) == "completed"
    with wstore.Session() as s:
        outs = s.execute(
            select(
                Output.custom_id, Output.completion_tokens, Output.forwards, Output.decoder, Output.error_code
            ).where(Output.run_id == run.run_id)
        ).all()
        n_traces = s.scalar(
            select(func.count()).select_from(ForwardTraceRow).where(ForwardTraceRow.run_id == run.run_id)
        )
    assert sorted(o[0] for o in outs) == [f"r{i}" for i in range(5)]
    assert all(o.error_code is None and 0 < o.completion_tokens <= 32 and o.forwards > 0 for o in outs)
    assert {o.decoder for o in outs} == {"official"}
    assert n_traces == sum(o.forwards for o in outs)  # one trace row per forward that served a request
    again = engine.process_chunk(run.chunk_ids[0])  # duplicate delivery after the rows were stored
    assert again.state == "empty" and again.written == 0 and again.attempt == 1  # not counted
    with wstore.Session() as s:
        assert s.scalar(select(func.count()).select_from(Output).where(Output.run_id == run.run_id)) == 5


def test_redelivery_after_partial_progress_skips_done_rows(wsettings, wstore, bundle):
    run = wstore.create_run(jobs(4), model=wsettings.model, queue="q", decoder="official", chunk_size=4)
    engine = engine_for(wsettings, wstore, bundle)
    # a first delivery that stored two rows, then its worker died
    claim = wstore.claim_chunk(run.chunk_ids[0], "dead:1", 60, 3)
    assert claim.state == "work"
    from canvasq.core.queue import ResultRecord

    wstore.write_results(
        run.run_id,
        [
            ResultRecord("r0", text="kept", completion_tokens=1),
            ResultRecord("r1", text="kept", completion_tokens=1),
        ],
        "dead:1",
    )
    out = engine.process_chunk(run.chunk_ids[0])
    assert out.written == 2
    with wstore.Session() as s:
        rows = dict(
            s.execute(select(Output.custom_id, Output.worker_id).where(Output.run_id == run.run_id)).all()
        )
    assert rows == {"r0": "dead:1", "r1": "dead:1", "r2": "test:1", "r3": "test:1"}


class FailingTokenizerBundle:
    """The real bundle, except that one marked prompt fails to tokenise (a worker-side row failure)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode_prompt(self, text, task=None):
        if "FAIL-TOKENIZER" in text:
            raise ValueError("cannot tokenise this prompt")
        return self._inner.encode_prompt(text, task)


def test_one_bad_row_errors_alone(wsettings, wstore, bundle):
    js = jobs(4)
    js[1] = Job("bad-tok", "FAIL-TOKENIZER please", "math", 32, None, 2)
    js[2] = Job("too-long", PROMPTS[0][1], "math", 1020, None, 3)  # prompt + 1020 tokens > 1024 positions
    run = wstore.create_run(js, model=wsettings.model, queue="q", decoder="official", chunk_size=4)
    engine = engine_for(wsettings, wstore, FailingTokenizerBundle(bundle))
    engine.process_chunk(run.chunk_ids[0])
    c = wstore.counts(run.run_id)
    assert (c["done"], c["errored"], c["queued"]) == (2, 2, 0)
    with wstore.Session() as s:
        codes = dict(
            s.execute(select(Output.custom_id, Output.error_code).where(Output.run_id == run.run_id)).all()
        )
    assert codes == {"r0": None, "bad-tok": "tokenizer_error", "too-long": "decode_error", "r3": None}


def test_cancelled_run_starts_no_work(wsettings, wstore, bundle):
    run = wstore.create_run(jobs(4), model=wsettings.model, queue="q", decoder="official", chunk_size=2)
    engine = engine_for(wsettings, wstore, bundle)
    engine.process_chunk(run.chunk_ids[0])
    assert wstore.cancel_run(run.run_id) == "cancelled"  # chunk 1 never started: cancelled at once
    out = engine.process_chunk(run.chunk_ids[1])  # its message arrives anyway
    assert out.state == "cancelled" and out.written == 0
    c = wstore.counts(run.run_id)
    assert (c["done"], c["cancelled"]) == (2, 2)


def test_should_stop_mid_chunk_keeps_finished_rows(wsettings, wstore, bundle):
    """The cancelling flag is seen between batches and between decoder steps."""
    run = wstore.create_run(jobs(8), model=wsettings.model, queue="q", decoder="official", chunk_size=8)
    calls = {"n": 0}

    def decode_then_cancel(bndl, batch, decoder, **kw):
        from canvasq.decoders import run_batch

        res = run_batch(bndl, batch, decoder, **kw)
        calls["n"] += 1
        if calls["n"] == 1:
            wstore.cancel_run(run.run_id)  # a user cancels while the first batch decodes
        return res

    engine = engine_for(wsettings, wstore, bundle, decode_fn=decode_then_cancel, stop_poll_s=0.0)
    engine.process_chunk(run.chunk_ids[0])
    c = wstore.counts(run.run_id)
    assert calls["n"] == 1
    assert (c["done"], c["cancelled"], c["queued"]) == (4, 4, 0)
    assert wstore.run_status(run.run_id) == "cancelled"


def test_attempts_cap_marks_worker_lost(wsettings, wstore, bundle):
    run = wstore.create_run(jobs(2), model=wsettings.model, queue="q", decoder="official", chunk_size=2)
    for _ in range(wsettings.max_attempts):  # deliveries whose worker died before writing anything
        assert wstore.claim_chunk(run.chunk_ids[0], "dead", 60, wsettings.max_attempts).state == "work"
    out = engine_for(wsettings, wstore, bundle).process_chunk(run.chunk_ids[0])
    assert out.state == "exhausted"
    c = wstore.counts(run.run_id)
    assert (c["errored"], c["queued"]) == (2, 0)
    assert wstore.run_status(run.run_id) == "completed"


@pytest.mark.parametrize("decoder", ["official"])
def test_seeded_output_is_reproducible(wsettings, wstore, bundle, decoder):
    a = wstore.create_run(jobs(2), model=wsettings.model, queue="q", decoder=decoder, chunk_size=2)
    b = wstore.create_run(jobs(2), model=wsettings.model, queue="q", decoder=decoder, chunk_size=2)
    engine = engine_for(wsettings, wstore, bundle)
    engine.process_chunk(a.chunk_ids[0])
    engine.process_chunk(b.chunk_ids[0])
    with wstore.Session() as s:
        texts = [
            dict(s.execute(select(Output.custom_id, Output.token_ids).where(Output.run_id == r.run_id)).all())
            for r in (a, b)
        ]
    assert texts[0] == texts[1]


def test_cuda_graphs_setting_reaches_the_step_decoders(wsettings, wstore, bundle, monkeypatch):
    """CANVASQ_CUDA_GRAPHS is validated and handed to run_batch by the engine; it sets the
    decoders' `cuda_graphs` (official on the runtime too; the hf reference arm has none and ignores
    it), and a per-call override still wins."""
    from pydantic import ValidationError

    from canvasq.core.settings import Settings
    from canvasq.decoders import run_batch
    from canvasq.decoders.registry import make_decoder

    monkeypatch.setenv("CANVASQ_CUDA_GRAPHS", "off")
    assert Settings().cuda_graphs == "off"
    monkeypatch.setenv("CANVASQ_CUDA_GRAPHS", "on")  # "on" is the CPU test path, not a service mode
    with pytest.raises(ValidationError):
        Settings()
    assert make_decoder("pipe", bundle, cuda_graphs="off").config.cuda_graphs == "off"
    assert make_decoder("funnel", bundle, {"cuda_graphs": "on"}, cuda_graphs="off").config.cuda_graphs == "on"
    assert make_decoder("official", bundle, cuda_graphs="off").config.cuda_graphs == "off"
    assert not hasattr(make_decoder("hf", bundle, cuda_graphs="off").config, "cuda_graphs")

    seen = []

    def recording(bndl, batch, decoder, **kw):
        seen.append(kw.get("cuda_graphs"))
        return run_batch(bndl, batch, decoder, **kw)

    settings = wsettings.model_copy(update={"cuda_graphs": "off"})
    run = wstore.create_run(jobs(2), model=settings.model, queue="q", decoder="auto", chunk_size=2)
    out = engine_for(settings, wstore, bundle, decode_fn=recording).process_chunk(run.chunk_ids[0])
    assert out.written == 2 and seen == ["off"]


def test_a_worker_pinned_to_cuda_n_selects_that_device(monkeypatch):
    """CANVASQ_DEVICE=cuda:N without CUDA_VISIBLE_DEVICES: the kernels and graphs use the current
    device's stream, so the worker must make N current before loading; cpu selects nothing."""
    import torch

    from canvasq.worker.devices import bind_cuda_device

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    bind_cuda_device("cpu")
    assert chosen == []
    bind_cuda_device("cuda:1")
    assert chosen == [torch.device("cuda:1")]


def test_device_setting_resolves_to_an_indexed_device():
    """auto / cuda take the current device's index (torch.cuda.set_device needs one); cuda:N must be
    visible; every refusal is one line naming CANVASQ_DEVICE."""
    from canvasq.worker.devices import resolve_device

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto", visible=0, current=0) == "cpu"
    assert resolve_device("auto", visible=2, current=1) == "cuda:1"
    assert resolve_device("cuda", visible=1, current=0) == "cuda:0"
    assert resolve_device("cuda:1", visible=2, current=0) == "cuda:1"
    for setting, visible in (("cuda", 0), ("cuda:2", 2), ("gpu", 1)):
        with pytest.raises(ValueError, match=r"^CANVASQ_DEVICE=") as err:
            resolve_device(setting, visible=visible, current=0)
        assert "\n" not in str(err.value)


def test_bare_cuda_binds_the_current_device(monkeypatch):
    import torch

    from canvasq.worker.devices import bind_cuda_device

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    bind_cuda_device("cuda")
    bind_cuda_device("cuda:0")
    assert chosen == [torch.device("cuda:3"), torch.device("cuda:0")]


def test_experts_setting_reaches_the_decoders(wsettings, wstore, bundle):
    """CANVASQ_EXPERTS resolved for the model's device: auto is bf16 on the CPU; an explicit value
    passes through (run_batch hands it to every decoder's config)."""
    from canvasq.decoders import run_batch

    seen = []

    def recording(bndl, batch, decoder, **kw):
        seen.append(kw.get("experts"))
        return run_batch(bndl, batch, decoder, **kw)

    for setting, want in (("auto", "bf16"), ("w4", "w4")):
        settings = wsettings.model_copy(update={"experts": setting})
        run = wstore.create_run(
            jobs(1, max_tokens=8), model=settings.model, queue="q", decoder="pipe", chunk_size=1
        )
        out = engine_for(settings, wstore, bundle, decode_fn=recording).process_chunk(run.chunk_ids[0])
        assert out.written == 1 and seen[-1] == want
    assert seen == ["bf16", "w4"]


def test_continuous_batching_keeps_slots_full_and_matches_rows_decoded_alone(
    wsettings, wstore, bundle, tmp_path, monkeypatch
):
    """A chunk of mixed max_tokens through 3 decode slots: rows are admitted largest max_tokens first,
    a finished row's slot is refilled before the next step (full until the chunk runs out of rows),
    every row is stored once, and each row's answer is what it gets decoded alone (the official
    decoder draws from per-request generators)."""
    from canvasq.decoders import DecodeBatch, DecodeRequest, run_batch

    settings = wsettings.model_copy(update={"decode_slots": 3})
    lengths = [8, 40, 16, 64, 8, 24, 48, 8, 32]
    js = [Job(f"r{i}", PROMPTS[i % 2][1], PROMPTS[i % 2][0], n, None, i + 1) for i, n in enumerate(lengths)]
    run = wstore.create_run(js, model=settings.model, queue="q", decoder="official", chunk_size=len(js))
    work = tmp_path / "work.log"
    monkeypatch.setenv("CANVASQ_TEST_WORK_LOG", str(work))  # each row's id as it is fed to a slot
    out = engine_for(settings, wstore, bundle).process_chunk(run.chunk_ids[0])
    assert out.written == len(js) and wstore.run_status(run.run_id) == "completed"
    fed = [line.split()[1] for line in work.read_text().splitlines()]
    assert fed == [
        "r3",
        "r6",
        "r1",
        "r8",
        "r5",
        "r2",
        "r0",
        "r4",
        "r7",
    ]  # 64, 48, 40, 32, 24, 16, then 8s in order
    occ = out.occupancy
    assert all(slots == 3 for _, slots in occ)
    # full while rows were waiting: the first step that runs below 3 is after the last row was fed,
    # so at most two rows (the ones still finishing) are ever missing from a step
    first_short = next(i for i, (n, _) in enumerate(occ) if n < 3)
    assert all(n == 3 for n, _ in occ[:first_short]) and first_short >= len(occ) // 2
    with wstore.Session() as s:
        got = dict(s.execute(select(Output.custom_id, Output.text).where(Output.run_id == run.run_id)).all())
    for j in js[:4]:
        req = DecodeRequest(j.custom_id, bundle.encode_prompt(j.prompt, j.task), j.max_tokens, j.task)
        alone = run_batch(bundle, DecodeBatch([req], seed=settings.seed), "official")[0]
        assert got[j.custom_id] == alone.text


@pytest.mark.parametrize("gib,want", [(141, 64), (80, 32)])
def test_decode_slots_default_by_device_memory(wsettings, wstore, bundle, monkeypatch, gib, want):
    """Unset, a GPU worker's slots follow the device's memory (64 on an H200, 32 on an 80 GiB card);
    the CPU keeps decode_batch_size and the setting wins everywhere."""
    import types

    engine = engine_for(wsettings, wstore, bundle)
    assert engine.decode_slots == wsettings.decode_batch_size  # the testbed bundle is on the CPU
    monkeypatch.setattr(engine.bundle, "device", "cuda:0", raising=False)
    props = types.SimpleNamespace(total_memory=gib * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert engine.decode_slots == want
    assert engine_for(wsettings.model_copy(update={"decode_slots": 5}), wstore, bundle).decode_slots == 5


def test_engine_starts_once_then_takes_chunks(wsettings, wstore, bundle):
    """`start()`: the worker registered and beating, and the default route's runtime and graph runner
    built before any chunk, its arena sized for the decode slots by a warm-up decode (on the CPU the
    prepared forwards a CUDA graph replays, `cuda_graphs` "on"); chunks then decode in that arena."""
    import time

    from canvasq.core.tables import Worker
    from canvasq.decoders.runtimes import runtime_for

    settings = wsettings.model_copy(update={"cuda_graphs": "on", "heartbeat_s": 0.05, "decode_slots": 4})
    run = wstore.create_run(jobs(4), model=settings.model, queue="q", decoder="official", chunk_size=4)
    with engine_for(settings, wstore, bundle).start() as engine:
        runner = runtime_for(
            bundle.hf_model, engine.experts, settings.fp8, settings.fp8_min_rows
        ).graph_runner
        assert runner is not None and runner.store is not None and runner.store.slots >= 4
        arena, built = runner.store, runner.stats["built"]
        assert built > 0  # the warm-up's forwards were prepared at start
        with wstore.Session() as s:
            first = s.get(Worker, "test:1").heartbeat_at
        time.sleep(0.3)
        with wstore.Session() as s:
            assert s.get(Worker, "test:1").heartbeat_at > first
        out = engine.run_chunk(run.chunk_ids[0])
        assert out.state == "work" and out.written == 4 and runner.store is arena
    assert wstore.run_status(run.run_id) == "completed"


def _recording_writes(wstore, monkeypatch) -> list[list[str]]:
    """The custom_ids of each `write_results` call on `wstore`, in order."""
    calls: list[list[str]] = []
    real = wstore.write_results

    def write_results(run_id, records, worker_id=None):
        calls.append([r.custom_id for r in records])
        return real(run_id, records, worker_id)

    monkeypatch.setattr(wstore, "write_results", write_results)
    return calls


def test_rows_that_end_in_one_step_are_written_in_one_call(wsettings, wstore, bundle, monkeypatch):
    """8 rows admitted together into 8 slots: the rows that end at the same decoder step (the same
    number of passes) reach the store in one write at that step's end, each row exactly once."""
    settings = wsettings.model_copy(update={"decode_slots": 8})
    run = wstore.create_run(jobs(8), model=settings.model, queue="q", decoder="official", chunk_size=8)
    calls = _recording_writes(wstore, monkeypatch)
    out = engine_for(settings, wstore, bundle).process_chunk(run.chunk_ids[0])
    assert out.written == 8 and wstore.run_status(run.run_id) == "completed"
    with wstore.Session() as s:
        forwards = dict(
            s.execute(select(Output.custom_id, Output.forwards).where(Output.run_id == run.run_id)).all()
        )
    by_step: dict[int, set[str]] = {}
    for cid, f in forwards.items():
        by_step.setdefault(f, set()).add(cid)
    assert sorted(map(sorted, calls)) == sorted(map(sorted, by_step.values()))
    assert len(calls) < 8  # the seeded rows end in fewer distinct steps than rows: some share a write


def test_a_stream_that_fails_mid_delivery_stores_the_rows_finished_before(
    wsettings, wstore, bundle, monkeypatch
):
    """A failure while a step's finished rows are handed over (here: building the second arith row's
    record raises; the four arith rows end in one step) still writes the row handed over before it in
    that step as done, never as errored; the failing row and the rows not finished error."""
    from canvasq.worker import streams

    settings = wsettings.model_copy(update={"decode_slots": 8})
    run = wstore.create_run(jobs(8), model=settings.model, queue="q", decoder="official", chunk_size=8)
    real, built, failing = streams.result_record, [], []

    def result_record(res, gen_ms, decoder):
        arith = int(res.custom_id[1:]) % 2 == 0  # jobs(): even rows are the arith prompt
        if arith and res.error is None:
            if built:
                failing.append(res.custom_id)
                raise RuntimeError(f"record of {res.custom_id}")
            built.append(res.custom_id)
        return real(res, gen_ms, decoder)

    monkeypatch.setattr(streams, "result_record", result_record)
    calls = _recording_writes(wstore, monkeypatch)
    engine_for(settings, wstore, bundle).process_chunk(run.chunk_ids[0])
    with wstore.Session() as s:
        st = dict(
            s.execute(select(Output.custom_id, Output.error_code).where(Output.run_id == run.run_id)).all()
        )
    done = {c for c, code in st.items() if code is None}
    assert len(st) == 8 and len(built) == 1 and len(failing) == 1
    assert built[0] in done and failing[0] not in done  # the pending row was flushed by the failure
    # the failure's flush is the write before the failed records (which name every row left)
    assert calls[-2] == built and set(st) - done <= set(calls[-1])


def test_out_of_device_memory_halves_the_slots_and_feeds_the_rows_again(
    wsettings, wstore, bundle, monkeypatch
):
    """A decoder step that runs out of device memory (here: any step of more than 2 rows raises
    torch.OutOfMemoryError) errors no row: the rows in flight are fed again, the stream restarts with
    half the slots (4 -> 2), the engine keeps 2, and every row's text is the one a 2-slot run gives.
    Out of memory at one slot errors the rows, as any failing pass does."""
    from canvasq.decoders.official import OfficialDecoder

    real_step = OfficialDecoder.step
    steps: list[int] = []

    def step(self, seqs, limit=2):
        steps.append(len(seqs))
        if len(seqs) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real_step(self, seqs)

    def texts(run_id):
        with wstore.Session() as s:
            q = select(Output.custom_id, Output.text, Output.error_code).where(Output.run_id == run_id)
            return {c: (t, e) for c, t, e in s.execute(q).all()}

    two = wsettings.model_copy(update={"decode_slots": 2})
    base = wstore.create_run(jobs(6), model=two.model, queue="q", decoder="official", chunk_size=6)
    engine_for(two, wstore, bundle).process_chunk(base.chunk_ids[0])
    want = texts(base.run_id)

    monkeypatch.setattr(OfficialDecoder, "step", step)
    four = wsettings.model_copy(update={"decode_slots": 4})
    run = wstore.create_run(jobs(6), model=four.model, queue="q", decoder="official", chunk_size=6)
    engine = engine_for(four, wstore, bundle)
    out = engine.process_chunk(run.chunk_ids[0])
    assert out.written == 6 and wstore.run_status(run.run_id) == "completed"
    assert steps[0] == 4 and max(steps[1:]) == 2 and engine.decode_slots == 2
    assert texts(run.run_id) == want and all(e is None for _, e in want.values())

    monkeypatch.setattr(OfficialDecoder, "step", lambda self, seqs: step(self, seqs, limit=0))
    one = wsettings.model_copy(update={"decode_slots": 1})
    run = wstore.create_run(jobs(2), model=one.model, queue="q", decoder="official", chunk_size=2)
    engine_for(one, wstore, bundle).process_chunk(run.chunk_ids[0])
    assert {e for _, e in texts(run.run_id).values()} == {"decode_error"}


def test_out_of_device_memory_drops_the_graph_runners_arena(wsettings, wstore, bundle):
    """The graph runner keeps its arena (the stream's, whatever its size) across streams; after an
    out-of-memory the back-off drops it with the graphs, so the stream on half the slots does not
    allocate beside it."""
    from canvasq.decoders.registry import make_decoder
    from canvasq.worker import streams

    dec = make_decoder("official", bundle, {"cuda_graphs": "on"})
    runner = dec.graphs
    assert runner is not None
    dec.arena = runner.arena(4, 64)
    runner.graphs[("a graph",)] = None

    class Refed:
        run_id = "run-1"

        def refeed(self) -> int:
            return 3

    engine = engine_for(wsettings.model_copy(update={"decode_slots": 4}), wstore, bundle)
    streams._back_off(engine, dec, Refed(), 4)
    assert dec.arena is None and runner.store is None and not runner.graphs
    assert engine.decode_slots == 2


def test_a_finished_stream_frees_its_arena_at_once(wsettings, wstore, bundle, monkeypatch):
    """The decoder and its slot pool refer to each other, so a finished stream's arena (35 GiB at 64
    slots on the H200) would wait for a garbage collection while the next chunk allocates its own: the
    worker releases it when the stream ends, so no reference to it is left."""
    import gc
    import weakref

    from canvasq.decoders import registry
    from canvasq.worker import streams

    made, real = [], registry.make_decoder

    def make_decoder(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(registry, "make_decoder", make_decoder)
    arenas: list = []
    real_decode_stream = streams._decode_stream

    def spy(engine, dec, stream, capacity, occupancy):
        real_decode_stream(engine, dec, stream, capacity, occupancy)
        arenas.append(weakref.ref(dec.arena.k[0]))

    monkeypatch.setattr(streams, "_decode_stream", spy)
    run = wstore.create_run(jobs(3), model=wsettings.model, queue="q", decoder="official", chunk_size=3)
    gc.disable()  # what is freed must be freed by reference counts alone
    try:
        engine_for(wsettings, wstore, bundle).process_chunk(run.chunk_ids[0])
        assert len(made) == 1 and len(arenas) == 1
        assert made[0].arena is None and arenas[0]() is None
    finally:
        gc.enable()


def test_the_loaded_model_is_kept_out_of_full_collections(wsettings, wstore):
    """Engine.bundle freezes the heap once the model is loaded (`loading.freeze_heap`): a full garbage
    collection mid-decode then walks only what the decoding made, not the model's objects."""
    import gc

    gc.unfreeze()
    engine = Engine(settings=wsettings, store=wstore, worker_id="test:1", queue="q")
    bundle = engine.bundle
    assert gc.get_freeze_count() > 0
    tracked = {id(o) for o in gc.get_objects()}
    held = [bundle, bundle.hf_model, *list(bundle.hf_model.modules())[:50], bundle.config]
    assert not any(id(o) in tracked for o in held if gc.is_tracked(o))
