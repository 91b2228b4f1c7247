"""What tests in several folders share: servers on loopback and the tiny stacks built on them."""
