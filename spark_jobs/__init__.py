"""kafold.spark_jobs"""
