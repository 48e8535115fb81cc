"""kafold.connectors"""
