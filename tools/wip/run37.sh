#!/usr/bin/env bash
# One call: B=32 varlen x 16: M (this tree, merge in the attention kernel, one wait for the
# weights) vs O (858c3d5's package), FlashMLA in M's runs; b128x4k M; the GPU suite; batch-1
# 131072 paged-vs-contiguous decomposition (run36); memcheck/racecheck on mma16's paged cases.
export PYTHONUNBUFFERED=1 LOG=/tmp/run37 MLASANDBOX_COMMIT=$1; rm -rf $LOG; mkdir -p $LOG
save() { tar czf $OUT/run37.tar.gz -C /tmp run37; }
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/sgl_flash_mla-*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $LOG/smi.txt
run() { n=$1; v=$2; shift 2; t0=$(date +%s)
  if [ $v = M ]; then timeout 60 python3 -m mlasandbox.cli.main bench "$@" --aa-rounds 2 --target-ms 25 --json $LOG/$n.json > $LOG/$n.txt 2>&1
  else PYTHONPATH=/tmp/site:$PWD/scratch/o858pkg timeout 60 python3 -m mlasandbox.cli.main bench "$@" --aa-rounds 2 --target-ms 25 --json $LOG/$n.json > $LOG/$n.txt 2>&1; fi
  echo "$n rc=$? ($(( $(date +%s) - t0 )) s) $(grep -E '^│ (mma16|flashmla \(peer\)) +│ (attn|combine|latent|step)' $LOG/$n.txt | cut -c1-48 | tr -s ' ' | tr '\n' ' ')"; save; }
run ab_M_b32var_r1 M --serving b32-8k-var-h16 --variants mma16 --peers flashmla
run ab_O_b32var_r1 O --serving b32-8k-var-h16 --variants mma16
run ab_M_b32var_r2 M --serving b32-8k-var-h16 --variants mma16 --peers flashmla
run ab_M_b128_r1 M --serving b128-4k-h16 --variants mma16 --peers flashmla
t0=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 16 -rf > $LOG/pytest_gpu_suite.txt 2>&1
echo "suite: $(tail -1 $LOG/pytest_gpu_suite.txt) ($(( $(date +%s) - t0 )) s)"; grep -E '^FAILED|^ERROR|^E  ' $LOG/pytest_gpu_suite.txt | cut -c1-300 | head -10; save
python3 tools/write_manifest.py $LOG --command "bash scratch/run37.sh (mlasandbox bench --serving b32-8k-var-h16 / b128-4k-h16 --variants mma16 [--peers flashmla] --aa-rounds 2 --target-ms 25 --json; O = 858c3d5's package)" --command "python3 -m pytest -q -p no:cacheprovider -n 16 -rf > pytest_gpu_suite.txt" > /dev/null 2>&1; save
cp cuda_src/mla_walk.cuh /tmp/walk.orig
for m in none len "len table"; do
  cp /tmp/walk.orig cuda_src/mla_walk.cuh; [ "$m" != none ] && python3 scratch/len_patch.py $m > /dev/null
  echo "== patch: $m" >> $LOG/seq.txt
  timeout 60 python3 scratch/seq_table.py >> $LOG/seq.txt 2>&1; save
done
cp /tmp/walk.orig cuda_src/mla_walk.cuh; grep -E "==|random|order|page 16|contiguous" $LOG/seq.txt | grep -v eager
for tool in memcheck racecheck; do extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  t0=$(date +%s); timeout 85 compute-sanitizer --tool $tool "${extra[@]}" --error-exitcode 3 --print-limit 1000 python3 scratch/san_mma16.py > $LOG/$tool.txt 2>&1
  echo "$tool rc=$? ($(( $(date +%s) - t0 )) s): $(grep -c '^ok' $LOG/$tool.txt) ok, $(grep -c '^FAIL' $LOG/$tool.txt) FAIL; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $LOG/$tool.txt | tail -1)"; save
done
