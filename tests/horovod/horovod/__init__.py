"""A stand-in for the `horovod` package, so that code written for Horovod runs on kolo with its
imports unchanged: `horovod.torch` is kolo.torch. It exists to run Horovod's own test suite
against kolo (tests/horovod/run_suite.py); training scripts should import kolo.torch."""
