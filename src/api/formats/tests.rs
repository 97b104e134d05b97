//! Unit tests of the folds.
