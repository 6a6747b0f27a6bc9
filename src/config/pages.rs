//! Pages (`pages.*` in the configuration): where the user is, as the request's context says
//! (page, tab, subtab), selects an identity, instructions for the prompt, tools and payload
//! types.

use serde_json::Value;

use crate::config::{PageSettings, Settings};

/// Where the user is: the page, tab and subtab a request names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Location<'a> {
    pub page: Option<&'a str>,
    pub tab: Option<&'a str>,
    pub subtab: Option<&'a str>,
}

impl<'a> Location<'a> {
    /// From a chat request's `context`: `current_page`, `active_tab`, `active_subtab`.
    pub fn of_context(context: Option<&'a Value>) -> Self {
        let field = |key: &str| context.and_then(|c| c.get(key)).and_then(Value::as_str);
        Self { page: field("current_page"), tab: field("active_tab"), subtab: field("active_subtab") }
    }
}

/// What a [`Location`] selects from `pages.*`: the deepest identity and instructions, and
/// the tools and payload types of every level.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PageScope {
    pub identity: Option<String>,
    pub instructions: Vec<String>,
    pub tools: Vec<String>,
    pub payload_types: Vec<String>,
}

impl PageScope {
    pub fn resolve(settings: &Settings, location: Location<'_>) -> Self {
        let mut scope = PageScope::default();
        let Some(page) = location.page.and_then(|p| settings.pages.get(p)) else {
            return scope;
        };
        scope.add(page);
        let tab = location.tab.and_then(|t| page.tabs.get(t));
        if let Some(tab) = tab {
            scope.add(tab);
        }
        let subtab = location.subtab.and_then(|s| tab.and_then(|t| t.subtabs.get(s)).or_else(|| page.subtabs.get(s)));
        if let Some(subtab) = subtab {
            scope.add(subtab);
        }
        scope
    }

    fn add(&mut self, level: &PageSettings) {
        if level.identity.is_some() {
            self.identity.clone_from(&level.identity);
        }
        self.instructions.extend(level.instructions.iter().cloned());
        self.tools.extend(level.tools.iter().cloned());
        self.payload_types.extend(level.payload_types.iter().cloned());
    }
}
