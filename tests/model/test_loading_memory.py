"""Peak host memory of a load, measured in a fresh process: a 1.07 GB checkpoint (MXFP4 experts, 5 shards) loaded as
rank 0 of 8 stays within what the rank keeps + the file pages mapped at once (reader.REOPEN_BYTES) + the largest
tensor + 100 MB, about a third of the checkpoint: nothing reads the whole checkpoint into host memory."""
import json
import subprocess
import sys

import torch

from k3compile.model.reader import REOPEN_BYTES

# 8 heads (split over 8 ranks); five MoE layers of 64 experts, latent 1024, intermediate 2048 (256 a rank):
# 214 MB of MXFP4 a layer
CONFIG = dict(num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, linear_num_heads=8,
              num_experts=64, routed_expert_hidden_size=1024, moe_intermediate_size=2048, intermediate_size=512)

# The child's peak is read from /proc/self/status (VmHWM, reset after the imports where the kernel allows):
# ru_maxrss would report the pytest process's size, which a forked child inherits on Linux.
CHILD = """
import json, sys, time, torch
from k3compile.model import KimiK3ForConditionalGeneration, TPContext
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024
try:
    open("/proc/self/clear_refs", "w").write("5")      # VmHWM := VmRSS
except OSError:
    pass
base, start = status("VmRSS"), time.perf_counter()
model = KimiK3ForConditionalGeneration.from_pretrained(sys.argv[1], tp=TPContext(0, 8), progress=False)
seconds = time.perf_counter() - start
loaded = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps(dict(base=base, peak=status("VmHWM"), loaded=loaded, seconds=seconds)))
"""


def test_load_peak_host_memory_is_bounded(tmp_path):
    from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration

    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(KimiK3Config.micro(**CONFIG)).convert_experts("mxfp4")
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.fill_(1 if p.dtype == torch.uint8 else 0.01)
    model.save_pretrained(tmp_path, max_shard_size=256 * 2 ** 20)
    del model
    files = list(tmp_path.glob("*.safetensors"))
    checkpoint = sum(f.stat().st_size for f in files)
    assert checkpoint > 1.0e9 and len(files) == 5
    largest = 2048 * 1024 // 2                                       # one expert's codes
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    extra = m["peak"] - m["base"]
    bound = m["loaded"] + REOPEN_BYTES + largest + 100e6
    assert extra <= bound, (extra / 1e6, bound / 1e6, m)
    assert extra < checkpoint / 2.5, (extra / 1e6, checkpoint / 1e6)
