"""The systems pdserve is measured against, each behind one small interface."""
