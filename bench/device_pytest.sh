# Run pytest files on a lent GPU machine in N processes at once (bench/NOTES.md): the GPU kernel tests spend most of
# their time in Triton's compiler, one CPU core a process, so N shards on the machine's 16 cores finish ~N times
# sooner than one pytest.  Usage: bash bench/device_pytest.sh N tests/a.py tests/b.py ...
# Prints each shard's summary line and exits non-zero if any shard failed (or collected nothing).
set -u
n=$1; shift
ids=$(mktemp)
python -m pytest -q --collect-only "$@" 2>/dev/null | grep "::" > "$ids"
[ -s "$ids" ] || { echo "no tests collected from $*"; exit 5; }
echo "$(wc -l < "$ids") tests in $n shards"
split -n "r/$n" -d "$ids" "$ids.shard"
pids=()
for shard in "$ids".shard[0-9][0-9]; do
    [ -s "$shard" ] || { rm "$shard"; continue; }  # more shards than tests: an empty one would run the whole suite
    python -m pytest -q -p no:cacheprovider $(cat "$shard") > "$shard.log" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
for shard in "$ids".shard[0-9][0-9]; do
    grep -E "FAILED|ERROR" "$shard.log" | head -20
    tail -1 "$shard.log"
done
exit $rc
