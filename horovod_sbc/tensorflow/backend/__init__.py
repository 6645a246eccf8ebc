"""The TensorFlow backends: encode and decode SBC's wire format in TensorFlow."""
