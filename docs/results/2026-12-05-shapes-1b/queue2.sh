#!/bin/bash
cd /work/main
while ! grep -q ALLDONE /tmp/b1/queue.log; do sleep 10; done
echo "== kvctl start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/b1/queue.log
.venv/bin/radixctl bench kvctl --model shape:llama-3.2-1b --sizes 2048,4096,8192 --reps 3 --out /tmp/b1/kvctl > /tmp/b1/kvctl.log 2>&1
echo "== kvctl exit $? $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/b1/queue.log
echo ALLDONE2 >> /tmp/b1/queue.log
