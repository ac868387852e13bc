"""One model on one mesh, stepped: the Layout (where every byte lives), the Region (the one reader
of ``parallel.mode``), the plain and pipelined loss-and-gradient steps, and the Engine that
gathers them."""
