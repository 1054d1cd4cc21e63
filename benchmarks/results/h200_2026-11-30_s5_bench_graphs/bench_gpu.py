import json, os, sys
from canvasq.decoders.bench import parse_arm, run_bench, markdown
from canvasq.model.loading import load_bundle
b = load_bundle(device="cuda")
rep = run_bench(b, [parse_arm(a) for a in ("official", "pipe", "funnel")], ["arith", "code"], 16, [1], batch_size=16, max_tokens=128)
print(markdown(rep))
open(os.path.join(os.environ.get("OUT", "/tmp"), "bench.json"), "w").write(json.dumps(rep, indent=1, default=str))
