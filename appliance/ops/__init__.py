"""Operations: the doctor and the remedies it applies, metrics, status, the traffic watch, the state dump,
and the generated reference."""
