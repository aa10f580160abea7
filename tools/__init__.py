"""What the project uses to test itself, outside the installed package: the mutation harness of the
gate."""
