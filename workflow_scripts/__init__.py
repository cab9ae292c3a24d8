"""workflow_scripts"""
