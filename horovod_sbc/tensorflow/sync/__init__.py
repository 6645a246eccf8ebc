"""The TensorFlow sync driver: one sync as graph pieces (encode, frame, allgather, decode)."""
