//! MCP servers (being written).
