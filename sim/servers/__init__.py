"""The simulated cluster and board served to the host: one server loop (:mod:`.loop`),
the servers it drives (:mod:`.cluster`, :mod:`.board`), the cocotb entry that starts
them in the simulator (:mod:`.entry`) and the child process that runs one (:mod:`.child`)."""
