"""Does KV held by idle slots slow a short prefill on another slot (unified KV, -kvu)?"""

# ruff: noqa
# fmt: off
# A study script kept as it was run (docs/results/2026-12-01-defaults); not held to the lint.
import json, subprocess, sys, time, urllib.request, os, random
BIN, MODEL = sys.argv[1], sys.argv[2]
port = 18777
p = subprocess.Popen([BIN, "-m", MODEL, "--host", "127.0.0.1", "--port", str(port), "-np", "4", "-c", "16384",
                      "-t", "2", "-kvu", "--cache-ram", "0", "-sps", "0", "--no-webui"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=600).read())
try:
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1); break
        except Exception: time.sleep(0.5)
    rnd = random.Random(0)
    words = "alpha beta gamma delta river stone cloud paper engine garden silver window".split()
    def text(n): return " ".join(rnd.choice(words) for _ in range(n))
    def short(i):
        r = post("/completion", {"prompt": f"Question {i}: " + text(18), "n_predict": 1, "id_slot": 3, "cache_prompt": False, "temperature": 0})
        return r["timings"]["prompt_n"], r["timings"]["prompt_ms"]
    empty = [short(i) for i in range(5)]
    for s in range(3):
        post("/completion", {"prompt": text(1400), "n_predict": 1, "id_slot": s, "cache_prompt": True, "temperature": 0})
    full = [short(10 + i) for i in range(5)]
    print("empty pool: short prefill (n, ms):", empty)
    print("3 idle slots holding ~1500 tokens each:", full)
    med = lambda xs: sorted(x[1] for x in xs)[len(xs)//2]
    print(f"median prompt_ms empty {med(empty):.1f} vs held {med(full):.1f}")
finally:
    p.terminate(); p.wait()
