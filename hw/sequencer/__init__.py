"""The collective sequencer: runs host-loaded programs of :mod:`fpgaccl.proto.isa`."""
