"""The launch layer: the `async-rl` commands, the launcher of a local run and its live display. It sits above the
roles (rollout/, replay/, learner/) and the kernel (async_rl/); nothing in the product imports it."""
