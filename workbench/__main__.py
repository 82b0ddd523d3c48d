"""`python -m workbench` and the `workbench` console script.

The host allocator's tunable (workbench/hardware/hostmem.py) is read by glibc when a process starts, so the command
line is re-executed with it before anything heavy is imported: the re-executed process imports JAX and the commands
once, not twice (~1.5 s of every command's start on a 2-core host)."""


def main():
    from workbench.hardware.hostmem import reexec_with_hugepages

    reexec_with_hugepages()
    from workbench.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    main()
