"""DMA: AXI4 read/write movers, address translation (host windows + GPU-peer page
table), the in-memory submission/completion queues with doorbells, and the GPU
completion-flag write-back."""
