"""One model directory on disk: validate and read it, plan and write a folded copy, publish it, load it."""
