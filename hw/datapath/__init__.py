"""The node's datapath: what turns sequencer commands into memory traffic, reductions and
RDMA WRITEs (copy engine, reduce engine, command router, memory port multiplexers)."""
