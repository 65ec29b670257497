from project.callbacks.last_checkpoint import LastCheckpoint
from project.callbacks.prediction_writer import PredictionCsvWriter
from project.callbacks.throughput import ThroughputLogger

__all__ = ["LastCheckpoint", "PredictionCsvWriter", "ThroughputLogger"]
