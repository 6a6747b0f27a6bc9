//! The API described and shown: the OpenAPI document (`openapi`), the bodies it describes
//! (`views`), and the web page and `/docs` that render them (`web`).

pub mod openapi;
pub mod views;
pub mod web;
