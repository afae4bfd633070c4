"""Chapter 09's GPT trained by PyTorch on the CPU: the "PyTorch next to ShardLab on one
device" comparison.

It trains the model ch09_gpt trains, with the same recipe, and measures how fast:

  model   Hugging Face's GPT2LMHeadModel built from a GPT2Config (no pretrained weights):
          4 layers, C 128, 4 heads, 64 bytes of context, a vocabulary of the 256 bytes,
          learned positions, pre-LayerNorm blocks (eps 1e-5), GELU in its tanh form
          (gelu_new), the LM head tied to wte, every dropout 0 - 0.83 M parameters, fp32
  data    the bytes of --text; each step 16 windows of 65 bytes at random places in its
          first 90 % (64 inputs, the same 64 shifted by one as targets)
  update  torch.optim.Adam(lr 3e-3, betas (0.9, 0.999), eps 1e-8, no weight decay) after
          clip_grad_norm_(1.0)

Step 1 warms up (allocations, first-call dispatch) and is not timed; steps 2..N are, and

  tokens/s = 16 * 64 * (N - 1) / their seconds

is printed with the first and the last step's loss (both should start near ln 256 = 5.55).
Compare it with one device of ShardLab on the same number of threads:

  python chapters/09_gpt/torch_baseline.py --threads 1 --steps 30
  build/default/bin/ch09_gpt --ranks 1 --tp 1 --pp 1 --no-reference --steps 30 --json --quiet

(ch09_gpt's "tokens_per_second" times all its steps, the first included.) The two losses
will not match number for number - the initial weights and the batches differ - but both
curves should fall alike.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

BATCH, CONTEXT, VOCAB = 16, 64, 256
CORPUS = Path(__file__).resolve().parent / "text" / "chapters.txt"  # ch09_gpt's --data


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (at least 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--text", default=str(CORPUS),
                        help="the text to learn, read as bytes (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 is not timed)")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    with open(args.text, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    split = len(data) * 9 // 10  # the first 90 % trains, as ch09_gpt's Corpus cuts it

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=CONTEXT, n_embd=128, n_layer=4, n_head=4,
        activation_function="gelu_new", layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).float().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=0.0)

    offsets = torch.arange(CONTEXT + 1)
    generator = torch.Generator().manual_seed(args.seed)

    def step():
        # 16 windows of T + 1 bytes that fit in the training text
        starts = torch.randint(0, split - CONTEXT, (BATCH, 1), generator=generator)
        window = data[starts + offsets]
        logits = model(input_ids=window[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    first = step()  # the warm-up step, not timed
    start = time.perf_counter()
    for _ in range(args.steps - 1):
        last = step()
    seconds = time.perf_counter() - start

    tokens = BATCH * CONTEXT * (args.steps - 1)
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} thread(s): GPT2LMHeadModel "
          f"(L 4, C 128, H 4, T 64, V 256; {model.num_parameters() / 1e6:g}M parameters, "
          f"attention {model.config._attn_implementation}), batch {BATCH} x {CONTEXT} bytes, "
          f"Adam lr 0.003, clip 1")
    print(f"loss: step 1 {first:.4f}, step {args.steps} {last:.4f}")
    print(f"{tokens / seconds:.2f} tokens/s ({seconds:.4g} s for steps 2..{args.steps})")


if __name__ == "__main__":
    main()
