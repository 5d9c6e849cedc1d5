# Stop what bench/device_queue.sh started on a lent GPU machine (bench/NOTES.md): every process of the queue's
# session (its commands and their children: pytest shards, ab_engine's runs). A `pkill -f` typed into the device
# call itself would match that call's own command line and end it.
for pid in $(pgrep -f "/root/res/DONE"); do
    sid=$(ps -o sid= -p "$pid" | tr -d ' ')
    [ -n "$sid" ] && pkill -s "$sid" && echo "stopped session $sid"
done
