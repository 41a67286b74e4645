#!/bin/bash
cd /work/main
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/b1/queue.log
  .venv/bin/radixctl bench "$@" --model shape:llama-3.2-1b --out /tmp/b1/$name > /tmp/b1/$name.log 2>&1
  echo "== $name exit $? $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/b1/queue.log; }
while pgrep -f "bench multi-round" >/dev/null; do sleep 5; done
run agents agents --arms legacy,proxy
run coding coding-agent --arms legacy,proxy
run fanout fanout --arms legacy,proxy
run tiers prefix-tiers --arms legacy,proxy --rounds 2
echo ALLDONE >> /tmp/b1/queue.log
