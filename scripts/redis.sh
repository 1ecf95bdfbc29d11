#!/usr/bin/env bash
# Starts a throwaway Redis on 127.0.0.1:6379 unless one already answers there.
set -euo pipefail
if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then exit 0; fi
command -v redis-server >/dev/null || { apt-get install -y -q redis-server >/dev/null || true; }
mkdir -p /tmp/specloop-redis
redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
  --dir /tmp/specloop-redis --logfile /tmp/specloop-redis/redis.log
for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && exit 0; sleep 0.1; done
echo "redis did not start" >&2; exit 1
