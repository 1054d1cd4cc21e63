import cProfile, pstats, sys, time, functools
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main")
import torch
import structured_output as so
from canvasq.decoders import make_decoder, constrained as cm
from canvasq.decoders.slots import drain
from canvasq.model.loading import load_bundle
from canvasq.testbed.json_adapter import apply_adapter
from canvasq.testbed import tasks
from canvasq.core.schemas import Limits
from canvasq.core.settings import Settings
from benchmarks.phases import PhaseClock
torch.set_num_threads(2)
bundle = load_bundle(None, device=sys.argv[1]); apply_adapter(bundle, "models/adapters/testbed_json_composite")
C = bundle.canvas_length
limits = Limits.for_model(Settings(schema_in_prompt=True), Settings().model)
probs = tasks.generate("arith", 192, 5, split="dev")
prof = cProfile.Profile()
for name in sys.argv[2:]:
    schema = so.SCHEMAS[name]
    mt = so.max_tokens_of(type("A",(),{"max_tokens":None,"think":True})(), name, C)
    reqs = [so.DecodeRequest(j.custom_id, bundle.encode_prompt(j.prompt, "arith"), mt, "arith", j.response_format, j.think)
            for j in so.jobs(probs, schema, mt, limits, think=True)]
    for rep in range(2):
        dec = make_decoder("official", bundle, {"cuda_graphs": "on"})
        saved = {n: getattr(cm.CanvasConstraints, n) for n in ("mask", "final", "checked", "begin")}
        def wrap(inner):
            def m(*a, **k):
                prof.enable()
                try: return inner(*a, **k)
                finally: prof.disable()
            return m
        if rep:
            for n, f in saved.items(): setattr(cm.CanvasConstraints, n, wrap(f))
        occ = []
        with PhaseClock() as clock:
            t0 = time.perf_counter(); drain(dec, reqs, 64, 5, occ); w = time.perf_counter() - t0
        for n, f in saved.items(): setattr(cm.CanvasConstraints, n, f)
        print(name, rep, clock.report(w, len(occ)))
st = pstats.Stats(prof); st.sort_stats("tottime").print_stats(45); st.sort_stats("cumulative").print_stats(40)
