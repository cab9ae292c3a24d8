"""report: the run's summary (summarize: tables; summary_plots: figures), the leaderboard and intervals
(winners), the grid's comparison (grid), provenance, and the report's pages (report_page). A new report page is
one row of the pages table and its caption (see the table's docstring)."""
