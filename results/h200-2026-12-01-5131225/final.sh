#!/usr/bin/env bash
# One device call: the GPU suite, then the benches the open issues name, FlashMLA in the run.
# The logs are tarred after every step, so what ran comes back even if the call is cut short.
export PYTHONUNBUFFERED=1 MLASANDBOX_COMMIT=$1 LOG=/tmp/run; mkdir -p $LOG
save() { tar czf $OUT/run.tar.gz -C /tmp run; }
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/sgl_flash_mla-*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site
t0=$(date +%s)
timeout ${2:-200} python3 -m pytest -q -p no:cacheprovider -n 12 -rf > $LOG/pytest_gpu_suite.txt 2>&1
echo "suite: $(tail -1 $LOG/pytest_gpu_suite.txt) ($(( $(date +%s) - t0 )) s)"
grep -E '^FAILED|^ERROR' $LOG/pytest_gpu_suite.txt | cut -c1-200 | head -20; save
B="python3 -m mlasandbox.cli.main bench"
run() { local name=$1; shift; local t=$1; shift; local s=$(date +%s)
  timeout $t $B "$@" --aa-rounds 3 --target-ms 40 --json $LOG/$name.json > $LOG/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"; save; }
run serving_b32-8k-var-h16 35 --serving b32-8k-var-h16 --variants mma16 --peers flashmla,torch
run serving_b128-4k-h16 35 --serving b128-4k-h16 --variants mma16 --peers flashmla
run serving_b128-4k-h128 40 --serving b128-4k-h128 --variants mma32,wgmma64 --q cache --peers flashmla
run b1_h128_paged 30 --batch 1 --lengths 131072 --heads 128 --variants wgmma64,mma32 --q cache --page-size 64 --peers flashmla
run b1_h16_paged 25 --batch 1 --lengths 131072 --heads 16 --variants mma16 --page-size 64 --peers flashmla
run b1_h16_contiguous 35 --ctx 64,1024,4096,131072 --heads 16 --variants mma16 --budget-s 20
run b1_h128_contiguous 25 --ctx 1024,4096 --heads 128 --variants mma32 --budget-s 15
run b1_h96_contiguous 20 --ctx 64 --heads 96 --variants mma32 --budget-s 8
python3 tools/write_manifest.py $LOG --notes "GPU suite; serving presets, batch-1 phases and wgmma64 with FlashMLA" --command "scratch/final.sh $1" > /dev/null 2>&1; echo "manifest rc=$?"; save
