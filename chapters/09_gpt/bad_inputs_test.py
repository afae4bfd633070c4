"""Chapter 09 against broken checkpoints and files that are not files: each run must end in
one line on stderr naming what is wrong, with exit code 2, within seconds.

    python3 bad_inputs_test.py PROGRAM CHECKPOINT SCRATCH

CHECKPOINT is a good one (ch09.save's); each case copies it to SCRATCH and breaks one thing.
The wrong versions this catches (each seen failing): reading trainer.json with
json::value() (a string step or a list gives nlohmann's type_error from every rank, exit 1);
comparing only a tensor's element count (a transposed [512, 128] c_fc loads); only its
shape (a transposed square c_proj loads; trainer.json's checksums catch it); no finiteness
check (a NaN weight trains and samples); opening --data or config.json without looking at
what it is (a pipe waits for a writer forever, /dev/zero reads forever); a default --data
baked in at build time (a program copied away without its text still read the source tree's).
"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys

program, checkpoint, scratch = sys.argv[1:4]
os.makedirs(scratch, exist_ok=True)
failures = []


def run(name, args, expect, binary=program):
    try:
        done = subprocess.run([binary, "--ranks", "1", "--tp", "1", "--pp", "1", *args],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        failures.append(f"{name}: no answer after 60 s (a hang)")
        return
    lines = done.stderr.splitlines()
    if done.returncode != 2 or len(lines) != 1 or not re.search(expect, lines[0]):
        failures.append(f"{name}: exit {done.returncode}, stderr {done.stderr!r}; "
                        f"wanted exit 2 and one line matching {expect!r}")


def copy(name):
    where = os.path.join(scratch, name)
    shutil.rmtree(where, ignore_errors=True)
    shutil.copytree(checkpoint, where)
    return where


def edit_json(name, file, change):
    """A copy of the checkpoint with its JSON `file` rewritten through change(value)."""
    where = copy(name)
    path = os.path.join(where, file)
    with open(path) as f:
        value = json.load(f)
    with open(path, "w") as f:
        json.dump(change(value), f)
    return where


def edit_trainer(name, change):
    return edit_json(name, "trainer.json", change)


def shards(where):
    return sorted(f for f in os.listdir(where) if f.startswith("model") and f.endswith(".safetensors"))


def edit_header(where, change):
    """Rewrites the first model shard's header through change(header) (same length, padded)."""
    path = os.path.join(where, shards(where)[0])
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    text = json.dumps(change(header), separators=(",", ":")).encode()
    assert len(text) <= n, "the edited header must fit in the old one's bytes"
    open(path, "wb").write(data[:8] + text.ljust(n) + data[8 + n:])
    return header


load = ["--steps", "1", "--no-reference", "--load"]
run("negative step", load + [edit_trainer("step", lambda s: {**s, "step": -5})],
    r"trainer\.json's step is -5, not a whole number")
run("step as text", load + [edit_trainer("text", lambda s: {**s, "step": "12"})],
    r"trainer\.json's step is \"12\", not a whole number")
run("trainer state a list", load + [edit_trainer("list", lambda s: [s])],
    r"trainer\.json is not a JSON object")
# A step the run would take past the counter's range: refused at the load (it had run, and
# failed as "a rank sent other than its axis' formula").
run("step near the counter's end", ["--steps", "2", "--no-reference", "--load",
                                    edit_trainer("last_steps", lambda s: {**s, "step": 2147483646})],
    r"is at step 2147483646: --steps 2 more would pass the step counter's 2\^31 - 1")


# An expert count that is no number: said so (it was read as a dense model's config and
# ended in two lines about missing tensors).
run("experts as a word", load + [edit_json("four", "config.json", lambda c: {**c, "num_local_experts": "four"})],
    r"config\.json's num_local_experts is \"four\", not a whole number of experts")

where = copy("transposed")
def transpose(header):
    name = "transformer.h.0.mlp.c_fc.weight"
    header[name]["shape"] = header[name]["shape"][::-1]
    return header
edit_header(where, transpose)
run("transposed matrix", load + [where], r"c_fc\.weight is 512x128, this model.s is 128x512")

# A square matrix transposed keeps its shape: trainer.json's checksums catch it, and a
# value changed by a bit.
where = copy("transposed_square")
path = os.path.join(where, shards(where)[0])
data = bytearray(open(path, "rb").read())
n = struct.unpack("<Q", data[:8])[0]
entry = json.loads(data[8:8 + n])["transformer.h.0.attn.c_proj.weight"]
rows, cols = entry["shape"]
assert rows == cols, "c_proj is square"
start = 8 + n + entry["data_offsets"][0]
values = struct.unpack(f"<{rows * cols}f", data[start:start + 4 * rows * cols])
flipped = [values[c * cols + r] for r in range(rows) for c in range(cols)]
data[start:start + 4 * rows * cols] = struct.pack(f"<{rows * cols}f", *flipped)
open(path, "wb").write(data)
run("square matrix transposed", load + [where],
    r"c_proj\.weight is not the tensor saved with it \(its FNV-1a differs")
where = copy("one_bit")
path = os.path.join(where, shards(where)[0])
data = bytearray(open(path, "rb").read())
data[start] ^= 1
open(path, "wb").write(data)
run("one bit changed", load + [where], r"c_proj\.weight is not the tensor saved with it")
run("checksums not an object", load + [edit_trainer("sums", lambda s: {**s, "model_fnv1a64": 3})],
    r"trainer\.json's model_fnv1a64 is not a JSON object")

where = copy("nan")
path = os.path.join(where, shards(where)[0])
data = bytearray(open(path, "rb").read())
n = struct.unpack("<Q", data[:8])[0]
start = json.loads(data[8:8 + n])["transformer.h.0.attn.c_proj.weight"]["data_offsets"][0]
data[8 + n + start:8 + n + start + 4] = struct.pack("<f", float("nan"))
open(path, "wb").write(data)
# (without trainer.json's checksums, as a checkpoint written elsewhere: the finiteness check)
with open(os.path.join(where, "trainer.json")) as f:
    state = json.load(f)
state.pop("model_fnv1a64")
with open(os.path.join(where, "trainer.json"), "w") as f:
    json.dump(state, f)
run("NaN weight", load + [where], r"c_proj\.weight holds NaN or infinite values")
run("NaN weight, sampling", ["--sample", "5", "--load", where], r"holds NaN or infinite values")

where = copy("fifo_config")
os.remove(os.path.join(where, "config.json"))
os.mkfifo(os.path.join(where, "config.json"))
run("config.json a pipe", load + [where], r"config\.json: not a regular file")
where = copy("fifo_index")
os.remove(os.path.join(where, "model.safetensors.index.json"))
os.mkfifo(os.path.join(where, "model.safetensors.index.json"))
run("the index a pipe", load + [where], r"index\.json: not a regular file")
fifo = os.path.join(scratch, "data.fifo")
if os.path.exists(fifo):
    os.remove(fifo)
os.mkfifo(fifo)
run("--data a pipe", ["--steps", "1", "--data", fifo], r"--data .*: not a regular file")
run("--data a device", ["--steps", "1", "--data", "/dev/zero"], r"--data .*: not a regular file")

# The default --data is the text beside the program, wherever the program is: copied away
# alone, it names the file it lacks; copied with ch09_gpt.txt, it trains.
moved = os.path.join(scratch, "moved")
shutil.rmtree(moved, ignore_errors=True)
os.makedirs(moved)
alone = shutil.copy2(program, moved)
text = os.path.join(moved, "ch09_gpt.txt")
run("program moved without its text", ["--steps", "1", "--no-reference"],
    re.escape(f"--data {text}") + ": ", alone)
shutil.copy2(os.path.join(os.path.dirname(program), "ch09_gpt.txt"), text)
done = subprocess.run([alone, "--ranks", "1", "--tp", "1", "--pp", "1", "--steps", "1",
                       "--no-reference", "--quiet"], capture_output=True, text=True, timeout=60)
if done.returncode != 0:
    failures.append(f"program moved with its text: exit {done.returncode}, {done.stderr!r}")

for failure in failures:
    print("FAILED", failure)
print(f"{len(failures)} of 18 cases mishandled")
sys.exit(1 if failures else 0)
