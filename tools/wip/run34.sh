#!/usr/bin/env bash
# One call: A/B at B=32 varlen x 16 heads: M (this tree: flat + the merge in the attention
# kernel), F (this tree with the attn merge off: flat + combine), O (HEAD's attention, combine),
# two rounds, FlashMLA in M's runs; b128x4k M vs F; then the whole GPU suite.
export PYTHONUNBUFFERED=1 LOG=/tmp/run34 MLASANDBOX_COMMIT=$1; rm -rf $LOG; mkdir -p $LOG
save() { tar czf $OUT/run34.tar.gz -C /tmp run34; }
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/sgl_flash_mla-*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $LOG/smi.txt
mkdir -p /tmp/src_m && cp cuda_src/mla_mma.cu cuda_src/mla_walk.cuh /tmp/src_m/
OFF='import sys, mlasandbox.registry as r; r.ATTN_MERGE_MAX_CHUNKS = 0; from mlasandbox.cli.main import main; sys.argv[0] = "mlasandbox"; main()'
run() { n=$1; v=$2; shift 2; t0=$(date +%s)
  if [ $v = M ]; then timeout 70 python3 -m mlasandbox.cli.main bench "$@" --aa-rounds 2 --target-ms 25 --json $LOG/$n.json > $LOG/$n.txt 2>&1
  else timeout 70 python3 -c "$OFF" bench "$@" --aa-rounds 2 --target-ms 25 --json $LOG/$n.json > $LOG/$n.txt 2>&1; fi
  echo "$n rc=$? ($(( $(date +%s) - t0 )) s) $(grep -E '^│ (mma16|flashmla \(peer\)) +│ (attn|combine|latent|step|graph)' $LOG/$n.txt | cut -c1-48 | tr -s ' ' | tr '\n' ' ')"; save; }
for r in 1 2; do for v in M F O; do
  cp /tmp/src_m/* cuda_src/; [ $v = O ] && cp scratch/old/mla_*.c* cuda_src/
  run ab_${v}_b32var_r$r $v --serving b32-8k-var-h16 --variants mma16 $( [ $v = M ] && echo --peers flashmla )
done; done
cp /tmp/src_m/* cuda_src/
for v in M F; do run ab_${v}_b128_r1 $v --serving b128-4k-h16 --variants mma16 $( [ $v = M ] && echo --peers flashmla ); done
t0=$(date +%s)
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 16 -rf > $LOG/pytest_gpu_suite.txt 2>&1
echo "suite: $(tail -1 $LOG/pytest_gpu_suite.txt) ($(( $(date +%s) - t0 )) s)"; grep -E '^FAILED|^ERROR' $LOG/pytest_gpu_suite.txt | cut -c1-300 | head -10
python3 tools/write_manifest.py $LOG --command "bash scratch/run34.sh (A/B: M = this tree, F = this tree with registry.ATTN_MERGE_MAX_CHUNKS = 0, O = 858c3d5's mla_mma.cu and mla_walk.cuh with the merge off; mlasandbox bench --serving b32-8k-var-h16 / b128-4k-h16 --variants mma16 [--peers flashmla] --aa-rounds 2 --target-ms 25 --json)" --command "python3 -m pytest -q -p no:cacheprovider -n 16 -rf > pytest_gpu_suite.txt" > /dev/null 2>&1; save
