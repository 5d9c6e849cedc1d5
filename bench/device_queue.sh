# Run benchmark / test commands one after another in the background on a lent GPU machine (bench/NOTES.md), from a
# copy of the tree, so that the calls that follow may re-sync the working tree and poll:
#   export COMMIT=abc1234; source bench/device_env.sh; bash bench/device_queue.sh 'python bench/x.py ...' 'pytest ...'
# Command i runs in /root/repo with OUT=/root/res/i (its JSON) and writes /root/res/i.log; /root/res/DONE marks the
# end. Poll with `sleep N; tail -3 /root/res/*.log` calls back to back (a machine idle 30 s is given back, and its
# files with it: copy /root/res/i into $OUT in a poll as soon as command i is done).
set -u
# A queue still running (a call that failed fast leaves its later commands going) would time its benchmarks beside
# this one's and write into the folders recreated below (session 39 lost a sweep so): refuse until it is stopped.
if [ -f /root/queue.pid ] && ps -o stat= -p "$(cat /root/queue.pid)" 2> /dev/null | grep -qv Z; then  # (a zombie: done)
    echo "a queue is still running (tail /root/res/*.log); stop it first: bash bench/device_stop.sh" >&2
    exit 1
fi
rm -rf /root/repo /root/res
cp -a . /root/repo
mkdir -p /root/res
cd /root/repo || exit 1
export PYTHONPATH="/tmp/site:/root/repo" PYTHONUNBUFFERED=1
i=0
script=""
for cmd in "$@"; do
    i=$((i + 1))
    mkdir -p "/root/res/$i"
    script+="OUT=/root/res/$i $cmd > /root/res/$i.log 2>&1; echo \"rc=\$?\" >> /root/res/$i.log; "
done
setsid nohup bash -c "${script}echo done > /root/res/DONE" > /dev/null 2>&1 &
echo $! > /root/queue.pid
echo "queued $i commands: logs /root/res/1..$i.log"
