#!/usr/bin/env bash
# Pool-based prefill/decode disaggregation on one host with a Mooncake pool:
# a development pool, a kv_producer, a kv_consumer and the proxy.
#   MODEL=models/tiny examples/pd_mooncake.sh
# On a real cluster, run `mooncake_master` and a memory-owning `mooncake_client`
# as services, set master_server_address to the master, protocol to rdma.
set -euo pipefail
MODEL=${MODEL:-models/tiny}
VLLM=(.venv/bin/python -m vllm.entrypoints.launchers.api_server.entry)  # `vllm serve` with a vllm wheel
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# Both instances must hash blocks identically: same (or no) PYTHONHASHSEED.
export PYTHONHASHSEED=0

# A master plus a 2 GB memory owner on loopback; writes the engines' settings.
.venv/bin/vllm-aio serve-mooncake --size 2GB --config-out /tmp/mooncake.json &
trap 'kill $(jobs -p) 2>/dev/null' EXIT
while [ ! -s /tmp/mooncake.json ]; do sleep 0.2; done
export MOONCAKE_CONFIG_PATH=/tmp/mooncake.json

kv() {  # $1: kv_role
  echo "{\"kv_connector\":\"AioConnector\",\"kv_role\":\"$1\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{\"backend\":\"mooncake\"}}"
}
common=(--model "$MODEL" --block-size 32 --max-model-len 4096 --enforce-eager)
"${VLLM[@]}" "${common[@]}" --port 8100 --kv-transfer-config "$(kv kv_producer)" &
"${VLLM[@]}" "${common[@]}" --port 8200 --kv-transfer-config "$(kv kv_consumer)" &
.venv/bin/python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
