#!/usr/bin/env bash
# The long-context evaluation of docs/results/accuracy.md (passkey and perplexity) on a GPU machine:
# passkey (words and repeat fillers) and streaming perplexity, Sink vs Cascade (4 and 8 cascades) vs Full,
# through the `jcascade` command. Usage: benchmarks/run_evaluation.sh MODEL_DIR OUT_DIR JOB...
# Jobs: passkey-CACHE-FILLER (Sink, Cascade x4, Cascade x8 at 4K-64K with --retention), full-FILLER
# (Full at 4K-32K), perplexity (caches 1K and 2K over 8 books, about 525K tokens). CACHE is 2048 or 4096.
set -euo pipefail
jcascade="${PYTHON:-python3} -m jcascade"
model=$1 out=$2
shift 2
sinks=64
policies() {  # Sink and Cascade (4 and 8 cascades) of the same size; stride = half the cache
  local size=$1 stride=$(($1 / 2))
  echo "--policy sink:window=$size,sinks=$sinks,stride=$stride" \
       "--policy cascade:cache_size=$size,sinks=$sinks,num_cascades=4,stride=$stride" \
       "--policy cascade:cache_size=$size,sinks=$sinks,num_cascades=8,stride=$stride"
}
books="--book paradise_lost --book comus --book poetical_works --book richard_iii --book hamlet --book coriolanus \
  --book troilus_and_cressida --book othello"
for job in "$@"; do
  echo "=== $job" >&2
  case $job in
    passkey-*-*)
      IFS=- read -r _ size filler <<<"$job"
      $jcascade passkey --model "$model" $(policies "$size") --min-length 4K --max-length 64K --samples 5 \
        --filler "$filler" --retention --out "$out/$job" ;;
    full-*)
      $jcascade passkey --model "$model" --policy full:stride=1024 --min-length 4K --max-length 32K --samples 5 \
        --filler "${job#full-}" --retention --out "$out/$job" ;;
    perplexity)
      for size in 1024 2048; do
        $jcascade perplexity --model "$model" $(policies "$size") $books --out "$out/perplexity-$size"
      done ;;
    *) echo "unknown job $job" >&2; exit 2 ;;
  esac
done
