#!/usr/bin/env bash
# GPU checks of the CUDA backend, on a machine with an NVIDIA GPU (no Rust needed there: build
# `cargo build --release` elsewhere and carry target/release/headroom).
#
#   scripts/gpu-check.sh [path/to/headroom] [gpu-check flags...]
#
# 1. `headroom train` of data/example-job.yaml on `cuda` (20 steps): the CLI, the event stream
#    and checkpoints end to end on the device; then the same job in bf16 with checkpointing and
#    every offload, preempted at step 10 and resumed to 20; with two GPUs, the job on two ranks,
#    as threads and as processes (the same losses).
#    Then the GPT-2 XL shape (1.48B) on 16 GiB: the plain job's time to its OOM, and bf16 +
#    checkpointing + optimizer offload's time to start and to its first steps.
# 2. `headroom gpu-check`, which prints its summary table last:
#    - every backend op (fp32 and bf16, two shapes) against the CPU reference with fresh random
#      inputs and NaN-poisoned outputs (relative-error bound per dtype);
#    - the device pool's OOM paths (device_memory capacity; cuMemAlloc refused by the driver);
#    - training parity: CUDA vs CPU losses step by step over 20 steps and the final weights,
#      fp32 and bf16, bf16 with checkpointing + every offload, and two ranks (ZeRO-1, ZeRO-3)
#      on the GPU against two CPU ranks;
#    - an OOM in training: a budget between the estimator's plain and fully checkpointed peaks,
#      where the plain job must OOM (typed, mid-step) and the checkpointed one must fit;
#    - the estimator against the device (--estimate-grid): 16 configurations, predicted and
#      measured peaks side by side;
#    - the GPT-2 124M benchmark: tokens/s at B=16, T=1024, bf16, resident and with the weights
#      in host memory (offload params over the copy stream: the step-time ratio), its per-op
#      profile, and the classifier's GEMMs at GPT-2's 50,257 logits a row and padded to 50,304
#      (whether the unaligned row costs cuBLAS speed: the case for padding the vocabulary);
# 3. `headroom gpu-check` again with HEADROOM_CUDA_ATTENTION=fused: the fused attention
#    kernels' (forward and backward) parity, training parity and benchmark beside the cuBLAS
#    path's.
# Exit status: that of gpu-check (1 if any check failed), or 1 if a training run failed.
set -uo pipefail
BIN=${1:-target/release/headroom}
[ -x "$BIN" ] || { echo "no executable at $BIN (build with: cargo build --release)" >&2; exit 2; }
BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
cd "$(dirname "$0")/.."

# libnvrtc and libcublas (CUDA 13 or 12) and libnccl from pip's nvidia-* wheels (CUDA 13:
# nvidia/cu13/lib; CUDA 12: nvidia/cuda_nvrtc/lib, nvidia/cublas/lib; nvidia/nccl/lib) or the
# CUDA toolkit, searched in that order.
lib_dirs=()
for site in $(python3 -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null); do
    for d in "$site"/*/lib; do lib_dirs+=("$d"); done
done
lib_dirs+=(/usr/local/cuda/lib64)
for d in "${lib_dirs[@]}"; do
    if compgen -G "$d/libnvrtc.so*" >/dev/null || compgen -G "$d/libcublas.so*" >/dev/null \
        || compgen -G "$d/libnccl.so*" >/dev/null; then
        LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
    fi
done
export LD_LIBRARY_PATH
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi not found"
echo "== headroom gpu-check --libraries"
"$BIN" gpu-check --libraries

job=$(mktemp /tmp/headroom-cuda-job.XXXXXX.yaml)
run=$(mktemp -d /tmp/headroom-cuda-run.XXXXXX)
sed 's/^device: .*/device: { kind: cuda, index: 0 }/; s/steps: 200/steps: 20/; s/eval_every: 50/eval_every: 10/' \
    data/example-job.yaml > "$job"
echo "== headroom train on cuda (data/example-job.yaml, 20 steps)"
"$BIN" train --config "$job" --fresh --run-dir "$run" > "$run/events.jsonl"
train_status=$?
grep -E '"event":"(started|eval|finished|oom)"' "$run/events.jsonl" | cut -c1-400
echo "train exit status: $train_status"

# The same job in bf16 with every host<->device technique (full checkpointing, int8 activation
# offload, weights and optimizer state in host memory: the copy stream), preempted after 10
# steps (exit 4, checkpoint) and resumed from the checkpoint to 20 (exit 0).
sed 's/precision: fp32/precision: bf16/; s/checkpointing: none/checkpointing: full\n  offload: { optimizer: cpu, params: cpu, activations: cpu-int8 }/' \
    "$job" > "$job.offload.yaml"
echo "== headroom train on cuda, bf16 + checkpointing + offload, stop after 10 steps, resume"
"$BIN" train --config "$job.offload.yaml" --fresh --run-dir "$run/offload" --stop-after 10 > "$run/offload.jsonl"
stop_status=$?
"$BIN" train --config "$job.offload.yaml" --resume --run-dir "$run/offload" >> "$run/offload.jsonl"
resume_status=$?
grep -E '"event":"(started|eval|checkpoint|finished|oom)"' "$run/offload.jsonl" | cut -c1-400
echo "stop exit status: $stop_status (expected 4), resume exit status: $resume_status (expected 0)"
{ [ $stop_status -eq 4 ] && [ $resume_status -eq 0 ]; } || train_status=1

# With two GPUs or more: the job on two ranks (cuda:0, cuda:1) at ZeRO-3, the collectives on
# NCCL (staged through the host when libnccl does not load: the log says which). gpu-check's
# training parity covers two ranks on one GPU (staged) and, with two GPUs, on NCCL.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
# `headroom train` of job file $1 into $run/$2 (events in $run/$2.jsonl), described as $3: its
# key events and exit status printed; returns that status.
two_gpu_train() {
    echo "== headroom train on cuda:0 and cuda:1 ($3)"
    "$BIN" train --config "$1" --fresh --run-dir "$run/$2" > "$run/$2.jsonl"
    local status=$?
    grep -E '"event":"(started|eval|finished|oom)"' "$run/$2.jsonl" | cut -c1-400
    echo "$3: train exit status $status"
    return $status
}
if [ "${gpus:-0}" -ge 2 ]; then
    sed 's/^memory:/memory:\n  world_size: 2\n  zero_stage: 3/; s/micro_batch: 16/micro_batch: 8/' "$job" > "$job.ranks.yaml"
    two_gpu_train "$job.ranks.yaml" ranks "2 ranks, ZeRO-3" || train_status=1
    # The same job with each rank its own process (memory.ranks: processes): NCCL communicators
    # from a unique id sent at the rendezvous; the losses must be the thread ranks' exactly.
    sed 's/^memory:/memory:\n  ranks: processes/' "$job.ranks.yaml" > "$job.procs.yaml"
    two_gpu_train "$job.procs.yaml" procs "2 rank processes, ZeRO-3"
    procs_status=$?
    losses() { grep -o '"loss":[^,]*' "$1"; }
    if [ $procs_status -eq 0 ] && [ "$(losses "$run/procs.jsonl")" = "$(losses "$run/ranks.jsonl")" ]; then
        echo "2 rank processes: exit 0, losses equal to the thread ranks'"
    else
        echo "2 rank processes: exit $procs_status; losses equal to the thread ranks': no"
        train_status=1
    fi
    # Tensor parallelism across the two GPUs: each rank computes half of every block (its
    # heads and MLP features), the partial sums on NCCL sub-communicators.
    sed 's/^memory:/memory:\n  world_size: 2\n  tensor_parallel: 2/' "$job" > "$job.tp.yaml"
    two_gpu_train "$job.tp.yaml" tp "tensor_parallel 2" || train_status=1
    # Two pipeline stages, one per GPU: activations and their gradients cross between them.
    sed 's/^memory:/memory:\n  world_size: 2\n  pipeline_parallel: 2/' "$job" > "$job.pp.yaml"
    two_gpu_train "$job.pp.yaml" pp "pipeline_parallel 2" || train_status=1
fi

# The seed's headline case at real scale: GPT-2 XL shape (1.48B parameters, bytes vocabulary)
# on a 16 GiB budget. The plain configuration cannot hold its state (exit 3: time to the OOM);
# bf16 + full checkpointing + optimizer offload fits (time to `started` and to the first step).
xl="$run/xl.yaml"
cat > "$xl" <<YAML
name: xl
model: { n_layer: 48, n_head: 25, n_embd: 1600, block_size: 1024, vocab: bytes }
data: { path: $PWD/data/shakespeare-tiny.txt, val_fraction: 0.1 }
train: { steps: 2, global_batch: 8, micro_batch: 8, lr: 1.0e-4, eval_every: 1000, checkpoint_every: 1000 }
device: { kind: cuda, device_memory: 16GiB }
YAML
python3 - "$BIN" "$xl" "$run" <<'PY' || train_status=1
import json, subprocess, sys, time
bin, xl, run = sys.argv[1:4]
def launch(config, name):
    t0 = time.time()
    p = subprocess.Popen([bin, "train", "--config", config, "--fresh", "--run-dir", f"{run}/{name}"],
                         stdout=subprocess.PIPE, stderr=open(f"{run}/{name}.log", "w"), text=True)
    return t0, p
# Plain: its state cannot fit 16 GiB; the time to the OOM.
t0, p = launch(xl, "xl-plain")
out, _ = p.communicate()
oom = [json.loads(l) for l in out.splitlines() if '"event":"oom"' in l]
print(f"XL plain on 16 GiB: exit {p.returncode} (expected 3) after {time.time() - t0:.2f} s; "
      + (f'oom {oom[0]["category"]} {oom[0]["requested_bytes"]} B' if oom else "no oom line"))
ok = p.returncode == 3
# bf16 + full checkpointing + optimizer offload: time to start and to the first two steps (then
# stopped: its final checkpoint would be 18 GB).
with open(xl) as f:
    text = f.read().replace("device:", "memory: { precision: bf16, checkpointing: full, offload: { optimizer: cpu } }\ndevice:")
with open(xl + ".fits.yaml", "w") as f:
    f.write(text)
t0, p = launch(xl + ".fits.yaml", "xl-fits")
steps = 0
for line in p.stdout:
    e = json.loads(line)
    if e["event"] in ("started", "step", "oom"):
        extra = ""
        if e["event"] == "step":
            steps += 1
            m = e["mem"]
            extra = (f' step {e["step"]}: {e["step_ms"]:.0f} ms, {e["tokens_per_s"]:.0f} tokens/s, allocated '
                     f'{m["allocated"]/2**30:.2f} GiB, reserved {m["reserved"]/2**30:.2f} GiB')
        print(f'XL bf16+full+opt-offload mb8 on 16 GiB: {e["event"]} at {e["t"] - t0:.2f} s{extra}')
    if e["event"] == "oom" or steps == 2:
        break
p.kill()
p.wait()
for l in open(f"{run}/xl-fits.log"):
    if "initialised in" in l:
        print(l.strip()[-160:])
ok = ok and steps == 2
sys.exit(0 if ok else 1)
PY

echo
echo "== headroom gpu-check"
"$BIN" gpu-check --estimate-grid --profile "${@:2}"
status=$?

# The fused attention kernels (16-bit, head sizes 32 and 64; off unless asked for): the op
# parity, the training parity and the GPT-2 benchmark and profile again with them, to compare
# with the cuBLAS path's above (attention_forward's and attention_backward's rows of each
# profile, and the benchmark's peak: no (T, T) scratch).
echo
echo "== HEADROOM_CUDA_ATTENTION=fused headroom gpu-check"
HEADROOM_CUDA_ATTENTION=fused "$BIN" gpu-check --xl-offload-steps 0 --profile "${@:2}"
fused_status=$?
[ $status -eq 0 ] && [ $fused_status -ne 0 ] && status=$fused_status
[ $status -eq 0 ] && [ $train_status -ne 0 ] && status=1
exit $status
