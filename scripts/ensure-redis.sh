#!/usr/bin/env bash
# Makes sure a Redis server answers at the given URL's host:port; starts Debian's redis-server if none does.
set -euo pipefail
url="${1:-redis://127.0.0.1:6379/0}"
hostport="${url#redis://}"; hostport="${hostport%%/*}"; hostport="${hostport##*@}"
host="${hostport%%:*}"; port="${hostport##*:}"; [ "$port" = "$host" ] && port=6379

ping() { (exec 3<>"/dev/tcp/$host/$port" && printf 'PING\r\n' >&3 && timeout 2 head -c 5 <&3 | grep -q PONG) 2>/dev/null; }

if ping; then echo "redis: answering at $host:$port"; exit 0; fi
if ! command -v redis-server >/dev/null; then
    echo "redis: no server at $host:$port and no redis-server; installing Debian's package"
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server >/dev/null; fi
fi
echo "redis: starting redis-server on $host:$port"
redis-server --daemonize yes --bind "$host" --port "$port" --save "" --appendonly no \
    --dir /tmp --logfile "/tmp/specprefill-redis-$port.log"
for _ in $(seq 50); do ping && { echo "redis: answering at $host:$port"; exit 0; }; sleep 0.1; done
echo "redis: could not start a server at $host:$port" >&2; exit 1
