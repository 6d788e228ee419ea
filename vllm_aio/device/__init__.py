"""What the worker half knows of the device the KV cache lives on: the accelerator behind one
interface (``accelerator.py``), where a block's bytes lie in vLLM's cache tensors (``block_layout.py``),
the host memory lent to copies (``staging.py``, ``host_copy.py``), host memory mapped for device kernels
(``npu_host_map.py``), the copy kernels (``plane_copy.py``, ``link_copy.py``) and the CPU's AMX
permission (``amx_permission.py``). Importing the package itself imports nothing (no torch).
"""
