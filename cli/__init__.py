"""The click + rich front end: `mlasandbox bench | sweep | regs | check | grid | repro | info`."""
