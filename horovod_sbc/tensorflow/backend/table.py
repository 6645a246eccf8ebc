"""The table the TF decoder's host parse returns: one int64 row per tensor message of a gathered
step, with these columns, and the kinds of message a row can describe."""

(C_TENSOR, C_RANK, C_COUNT, C_B, C_KIND, C_USTART, C_UBYTES, C_RSTART, C_SSTART, C_VSTART,
 C_VBITS, C_NEG, C_NUMEL, C_RBYTES, C_SBYTES) = range(15)
N_COLS = 15
K_BINARY, K_SIGNS, K_VALUES, K_ALL_SIGNS, K_ALL_VALUES = range(5)
