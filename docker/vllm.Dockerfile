# vLLM with the specprefill-vllm plugin: kept tokens at their original positions (vllm_xargs.position_ids).
# The plugin supports vLLM 0.32.x only; keep this tag in step with vllm_plugin/specprefill_vllm/__init__.py.
FROM vllm/vllm-openai:v0.32.0

COPY vllm_plugin /opt/specprefill-vllm
RUN pip install --no-cache-dir /opt/specprefill-vllm
# positions ride on the V1 model runner (the plugin also defaults this)
ENV VLLM_USE_V2_MODEL_RUNNER=0
