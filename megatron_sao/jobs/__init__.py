"""Jobs: short drivers behind the `sao` sub-commands (train, sft, ...). Step logic lives in
`training/`, the async machinery in `pipeline/`; a job only wires config, processes and logging."""
