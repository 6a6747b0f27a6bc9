//! Typed settings: `config/default.toml` (embedded in the binary), then `config/local.toml`,
//! then the file named by `--config` / `CHATD_CONFIG`, then `CHATD_*` environment variables
//! with `__` between levels. Secrets live in [`Secret`], whose `Debug` prints `***`.
//!
//! Strict: a key no section has (a typo) stops the start, naming the key, where it came
//! from and the nearest valid key. A `CHATD_*` variable without `__` is not configuration
//! (no key is one level deep); one that looks like a key written with a single `_` gets a
//! warning.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::{Deserialize, Serialize};

pub mod pages;
mod report;
mod sections;
mod tools;

pub use report::*;
pub use sections::*;
use sections::{
    all_tools, default_connect_timeout, default_http2_connections, default_max_iterations, default_max_retries,
    default_retry_base, default_retry_max, default_stream_timeout,
};
pub use tools::*;

/// The defaults shipped in the repository, compiled in so the binary runs from any folder.
const DEFAULT_TOML: &str = include_str!("../../config/default.toml");

/// Name of the provider and profile chatd adds when none is configured.
pub const MOCK_ID: &str = "mock";

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub server: ServerSettings,
    pub database: DatabaseSettings,
    pub auth: AuthSettings,
    pub limits: Limits,
    pub stream: StreamSettings,
    pub chat: ChatSettings,
    #[serde(default)]
    pub runs: RunsSettings,
    #[serde(default)]
    pub providers: BTreeMap<String, ProviderSettings>,
    #[serde(default)]
    pub profiles: BTreeMap<String, ProfileSettings>,
    pub tools: ToolSettings,
    #[serde(default)]
    pub mcp_servers: BTreeMap<String, McpServerSettings>,
    #[serde(default)]
    pub http_tools: BTreeMap<String, HttpToolSettings>,
    #[serde(default)]
    pub pages: BTreeMap<String, PageSettings>,
    #[serde(default)]
    pub payload_types: BTreeMap<String, PayloadTypeSettings>,
    #[serde(default)]
    pub actions: BTreeMap<String, ActionSettings>,
    #[serde(default)]
    pub client_tools: BTreeMap<String, ClientToolSettings>,
    pub files: FileSettings,
    /// Prices per model that override or add to the price table (CONTRACT.md §18).
    #[serde(default)]
    pub pricing: BTreeMap<String, ModelPricing>,
    /// Signed webhooks (CONTRACT.md §18).
    #[serde(default)]
    pub webhooks: WebhooksSettings,
    /// Traces exported over OTLP (CONTRACT.md §18).
    #[serde(default)]
    pub telemetry: TelemetrySettings,
}

/// A secret string: deserialized as is, printed and serialized as `***`.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("***")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config: {0}")]
    Parse(#[from] Box<figment::Error>),
    #[error("config: {0}")]
    Invalid(String),
}

impl Settings {
    /// Loads the layered configuration; `file` is `--config` / `CHATD_CONFIG`.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut figment = Figment::new().merge(Toml::string(DEFAULT_TOML)).merge(Toml::file("config/local.toml"));
        if let Some(file) = file {
            if !file.exists() {
                return Err(ConfigError::Invalid(format!("config file {} does not exist", file.display())));
            }
            // By its whole path, so an error names the file whatever folder chatd was started
            // from; and exactly that file (figment's `file` would look for a relative path in
            // the parent folders too).
            let file = std::fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
            figment = figment.merge(Toml::file_exact(file));
        }
        Self::from_figment(figment.merge(environment()))
    }

    /// Builds settings from a figment (tests layer their own values this way).
    pub fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        let mut settings: Settings = figment.extract().map_err(|e| readable(&figment, e))?;
        settings.resolve()?;
        Ok(settings)
    }

    /// The defaults with each TOML text layered on top, in order.
    pub fn from_layers(layers: &[&str]) -> Result<Self, ConfigError> {
        let figment = layers
            .iter()
            .fold(Figment::new().merge(Toml::string(DEFAULT_TOML)), |f, layer| f.merge(Toml::string(layer)));
        Self::from_figment(figment)
    }

    /// The defaults alone, with `overrides` (TOML text) on top.
    pub fn with_overrides(overrides: &str) -> Result<Self, ConfigError> {
        Self::from_figment(Figment::new().merge(Toml::string(DEFAULT_TOML)).merge(Toml::string(overrides)))
    }

    /// Fills secrets from the environment and files, adds the mock model (its provider
    /// always, unless one is named `mock`; a `default` profile on it when no profile is
    /// configured), and checks that every reference points somewhere.
    fn resolve(&mut self) -> Result<(), ConfigError> {
        self.providers.entry(MOCK_ID.to_owned()).or_insert_with(|| ProviderSettings {
            kind: ProviderKind::Mock,
            base_url: None,
            api_key_env: None,
            api_key_envs: Vec::new(),
            api_key_file: None,
            api_key: None,
            api_keys: Vec::new(),
            connect_timeout_secs: default_connect_timeout(),
            first_byte_timeout_secs: default_stream_timeout(),
            idle_timeout_secs: default_stream_timeout(),
            max_retries: default_max_retries(),
            retry_base_secs: default_retry_base(),
            retry_max_secs: default_retry_max(),
            http2: false,
            http2_connections: default_http2_connections(),
            chunk_chars: None,
            delay_ms: None,
            thinking: None,
            rules: Vec::new(),
        });
        if self.profiles.is_empty() {
            self.profiles.insert(
                self.chat.default_profile.clone(),
                ProfileSettings {
                    provider: MOCK_ID.to_owned(),
                    model: "mock-1".to_owned(),
                    system_prompt: Some("You are a helpful assistant.".to_owned()),
                    temperature: None,
                    max_tokens: None,
                    enable_thinking: true,
                    thinking_budget: None,
                    reasoning_effort: None,
                    context_limit: None,
                    max_iterations: default_max_iterations(),
                    tools: all_tools(),
                    require_approval: Vec::new(),
                    // The mock acknowledges what it is sent, so a newcomer can try every kind.
                    modalities: vec![Modality::Text, Modality::Image, Modality::Pdf],
                    fallbacks: Vec::new(),
                    prompt_cache: PromptCache::Auto,
                    prompt_cache_ttl: CacheTtl::FiveMinutes,
                },
            );
        }
        for (id, provider) in &mut self.providers {
            provider.api_key = read_api_key(id, provider)?;
            if !provider.api_key_envs.is_empty() && (provider.api_key_env.is_some() || provider.api_key_file.is_some())
            {
                return Err(ConfigError::Invalid(format!(
                    "providers.{id}.api_key_envs names the keys already: leave out api_key_env and api_key_file"
                )));
            }
            provider.api_keys = provider
                .api_key_envs
                .iter()
                .filter_map(|var| std::env::var(var).ok().filter(|key| !key.is_empty()).map(Secret::new))
                .collect();
            if provider.kind != ProviderKind::Mock {
                if let Some(key) = provider.mock_keys_set().first() {
                    return Err(ConfigError::Invalid(format!(
                        "providers.{id}.{key} is an option of the mock model (kind = \"mock\"); remove it from this provider"
                    )));
                }
            }
        }
        for (id, profile) in &self.profiles {
            if !self.providers.contains_key(&profile.provider) {
                return Err(ConfigError::Invalid(format!(
                    "profiles.{id}.provider names unknown provider '{}'",
                    profile.provider
                )));
            }
            if profile.model.trim().is_empty() {
                return Err(ConfigError::Invalid(format!("profiles.{id}.model is empty")));
            }
            for fallback in &profile.fallbacks {
                if fallback == id {
                    return Err(ConfigError::Invalid(format!("profiles.{id}.fallbacks names the profile itself")));
                }
                if !self.profiles.contains_key(fallback) {
                    let known: Vec<&str> = self.profiles.keys().map(String::as_str).collect();
                    return Err(ConfigError::Invalid(format!(
                        "profiles.{id}.fallbacks names unknown profile '{fallback}' (profiles: {})",
                        known.join(", ")
                    )));
                }
            }
        }
        // Ten years at most: a deadline must stay a date.
        let timeout = self.tools.approval_timeout_secs;
        if !(timeout.is_finite() && timeout > 0.0 && timeout <= 315_576_000.0) {
            return Err(ConfigError::Invalid(format!(
                "tools.approval_timeout_secs is {timeout}: give a number of seconds above 0 and at most 315576000 (ten years)"
            )));
        }
        if !self.files.url.starts_with("file://") && !self.files.url.starts_with("s3://") {
            return Err(ConfigError::Invalid(format!(
                "files.url is '{}': give file://FOLDER or s3://BUCKET/PREFIX",
                self.files.url
            )));
        }
        if !self.profiles.contains_key(&self.chat.default_profile) {
            return Err(ConfigError::Invalid(format!(
                "chat.default_profile '{}' is not a configured profile: set it to one of {} \
                 (CHATD_CHAT__DEFAULT_PROFILE)",
                self.chat.default_profile,
                self.profiles.keys().map(String::as_str).collect::<Vec<_>>().join(", ")
            )));
        }
        if let Some(path) = &self.auth.tokens_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| ConfigError::Invalid(format!("auth.tokens_file {}: {e}", path.display())))?;
            for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
                let mut parts = line.split_whitespace();
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(token), Some(user), None) => {
                        self.auth.tokens.insert(token.to_owned(), user.to_owned());
                    }
                    _ => {
                        return Err(ConfigError::Invalid(format!(
                            "auth.tokens_file {}: each line must be `token user`",
                            path.display()
                        )));
                    }
                }
            }
        }
        if self.auth.mode == AuthMode::Jwt {
            let jwt = &mut self.auth.jwt;
            let read = |what: &str, path: &Path| {
                std::fs::read_to_string(path)
                    .map_err(|e| ConfigError::Invalid(format!("auth.jwt.{what} {}: {e}", path.display())))
            };
            if let Some(path) = &jwt.public_key_file {
                jwt.public_key_pem = Some(read("public_key_file", path)?);
            } else if let Some(path) = &jwt.secret_file {
                jwt.secret = Some(Secret::new(read("secret_file", path)?.trim()));
            } else if let Some(var) = &jwt.secret_env {
                jwt.secret = std::env::var(var).ok().filter(|s| !s.is_empty()).map(Secret::new);
            }
            if jwt.secret.is_none() && jwt.public_key_pem.is_none() {
                return Err(ConfigError::Invalid(
                    "auth.mode = \"jwt\" needs auth.jwt.public_key_file, secret_file or secret_env (set)".to_owned(),
                ));
            }
        }
        if self.auth.mode == AuthMode::Token && self.auth.tokens.is_empty() {
            return Err(ConfigError::Invalid(
                "auth.mode = \"token\" needs [auth.tokens] or auth.tokens_file".to_owned(),
            ));
        }
        if let Some((id, _)) = self.providers.iter().find(|(_, p)| p.http2_connections == 0) {
            return Err(ConfigError::Invalid(format!("providers.{id}.http2_connections must be at least 1")));
        }
        if self.stream.flush_max_events == 0 || self.limits.max_page_size == 0 {
            return Err(ConfigError::Invalid(
                "stream.flush_max_events and limits.max_page_size must be at least 1".to_owned(),
            ));
        }
        // A price or a dollar budget below 0 (or not a number) would make every cost a lie.
        let bad_price = self.pricing.iter().find(|(_, p)| {
            [Some(p.input_per_mtok), Some(p.output_per_mtok), p.cache_read_per_mtok, p.cache_write_per_mtok]
                .into_iter()
                .flatten()
                .any(|v| !(v.is_finite() && v >= 0.0))
        });
        if let Some((model, _)) = bad_price {
            return Err(ConfigError::Invalid(format!(
                "pricing.\"{model}\": every price must be a number of US dollars per million tokens, 0 or more"
            )));
        }
        let usd_budgets = std::iter::once(("limits.budget_usd_per_month".to_owned(), self.limits.budget_usd_per_month))
            .chain(
                self.limits.budgets.iter().map(|(u, b)| (format!("limits.budgets.{u}.usd_per_month"), b.usd_per_month)),
            );
        for (key, usd) in usd_budgets {
            if usd.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
                return Err(ConfigError::Invalid(format!("{key} must be a number of US dollars, 0 or more")));
            }
        }
        let runs = &self.runs;
        if !(runs.heartbeat_secs > 0.0 && runs.takeover_after_secs > runs.heartbeat_secs) {
            return Err(ConfigError::Invalid(format!(
                "runs.takeover_after_secs ({}) must be longer than runs.heartbeat_secs ({}), which must be above 0: \
                 a replica is taken over only after several missed heartbeats",
                runs.takeover_after_secs, runs.heartbeat_secs
            )));
        }
        self.webhooks.check().map_err(ConfigError::Invalid)?;
        self.webhooks.resolve_secrets().map_err(ConfigError::Invalid)?;
        Ok(())
    }
}

/// The `CHATD_*` variables that are configuration: those with `__` between a section and
/// its key. The others are not (`CHATD_CONFIG` names the file; tests and scripts set their
/// own); one that reads like a key written with `_` (`CHATD_SERVER_PORT`) gets a warning.
fn environment() -> Env {
    for name in std::env::vars_os().filter_map(|(name, _)| name.into_string().ok()) {
        let Some(rest) = name.strip_prefix("CHATD_").filter(|rest| !rest.contains("__")) else { continue };
        let lower = rest.to_ascii_lowercase();
        if let Some(section) = SECTIONS.iter().find(|s| lower.starts_with(&format!("{s}_"))) {
            let key = &rest[section.len() + 1..];
            eprintln!(
                "warning: {name} is not configuration: a section and its key are separated by `__` \
                 (CHATD_{}__{key})",
                section.to_ascii_uppercase()
            );
        }
    }
    Env::prefixed("CHATD_").filter(|key| key.as_str().contains("__")).split("__")
}

/// The top-level sections, as a `CHATD_` variable starts them.
const SECTIONS: [&str; 14] = [
    "server",
    "database",
    "auth",
    "limits",
    "stream",
    "chat",
    "providers",
    "profiles",
    "tools",
    "mcp_servers",
    "http_tools",
    "pages",
    "payload_types",
    "actions",
];

/// A figment error made into a message for a person, in the words of the configuration: the
/// key as it is written (figment's own message prefixes its profile, `default.`), the file or
/// variable it came from, and what would be valid. A key no section has gets the nearest
/// valid key; a value none of a key's choices is gets the choices.
fn readable(figment: &Figment, error: figment::Error) -> ConfigError {
    match &error.kind {
        figment::error::Kind::UnknownField(field, expected) => {
            // figment's path ends with the unknown key itself.
            let mut path = error.path.clone();
            if path.last() != Some(field) {
                path.push(field.clone());
            }
            let key = path.join(".");
            let from = source(figment, &key);
            let parent = &key[..key.len() - field.len()];
            let hint = match nearest(field, expected) {
                Some(candidate) => format!("did you mean `{parent}{candidate}`?"),
                None => format!("the keys here are: {}", expected.join(", ")),
            };
            ConfigError::Invalid(format!(
                "unknown key `{key}`{from}: {hint} (fix or remove it; docs/configuration.md lists every key)"
            ))
        }
        figment::error::Kind::UnknownVariant(value, expected) => {
            let key = error.path.join(".");
            let from = source(figment, &key);
            let hint = match nearest(value, expected) {
                Some(candidate) => format!(" (did you mean \"{candidate}\"?)"),
                None => String::new(),
            };
            ConfigError::Invalid(format!("{key} = \"{value}\"{from} is not one of: {}{hint}", expected.join(", ")))
        }
        // Any other value that does not fit its key: figment's words for the value, with the
        // key and its source as above.
        kind if !error.path.is_empty() => {
            let key = error.path.join(".");
            ConfigError::Invalid(format!("{key}{}: {kind}", source(figment, &key)))
        }
        _ => ConfigError::Parse(Box::new(error)),
    }
}

/// Where `key` was set: ` in FILE` (as given, made absolute by [`Settings::load`]), ` from
/// the environment variable CHATD_…`, or nothing when figment cannot tell.
fn source(figment: &Figment, key: &str) -> String {
    match figment.find_metadata(key) {
        Some(metadata) => match &metadata.source {
            Some(figment::Source::File(path)) => format!(" in {}", path.display()),
            _ if metadata.name.contains("environment") => {
                format!(" from the environment variable CHATD_{}", key.replace('.', "__").to_ascii_uppercase())
            }
            _ => format!(" in {}", metadata.name),
        },
        None => String::new(),
    }
}

/// The candidate closest to `written`, if it is close enough to be what was meant.
fn nearest<'a>(written: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|candidate| (strsim::damerau_levenshtein(written, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= candidate.len().max(written.len()) / 2)
        .min()
        .map(|(_, candidate)| candidate)
}

fn read_api_key(id: &str, provider: &ProviderSettings) -> Result<Option<Secret>, ConfigError> {
    if let Some(path) = &provider.api_key_file {
        let key = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Invalid(format!("providers.{id}.api_key_file {}: {e}", path.display())))?;
        return Ok(Some(Secret::new(key.trim())));
    }
    Ok(provider
        .api_key_env
        .as_deref()
        .and_then(|var| std::env::var(var).ok())
        .filter(|key| !key.is_empty())
        .map(Secret::new))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let mut settings = Settings::with_overrides("[database]\nurl = \"postgres://u:hunter2@db/chat\"").unwrap();
        settings.auth.tokens.insert("tok-hunter2".into(), "alice".into());
        let debug = format!("{settings:?}");
        let json = serde_json::to_string(&settings).unwrap();
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(!json.contains("hunter2"), "{json}");
        assert_eq!(settings.database.url.expose(), "postgres://u:hunter2@db/chat");
    }

    #[test]
    fn a_key_no_section_has_stops_the_load_with_the_nearest_valid_key() {
        let refused = |toml: &str| Settings::with_overrides(toml).expect_err(toml).to_string();
        let typo = refused("[server]\nprot = 9000");
        assert!(typo.contains("unknown key `server.prot`") && typo.contains("did you mean `server.port`?"), "{typo}");
        let section = refused("[sever]\nport = 9000");
        assert!(section.contains("unknown key `sever`") && section.contains("did you mean `server`?"), "{section}");
        let profile = refused("[profiles.fast]\nprovider = \"mock\"\nmodel = \"m\"\ntemprature = 0.2");
        assert!(profile.contains("`profiles.fast.temperature`"), "{profile}");
        let far = refused("[server]\nzzzzzzzz = 1");
        assert!(far.contains("the keys here are: ") && far.contains("port"), "{far}");
        let mock_only = refused("[providers.oa]\nkind = \"openai\"\nchunk_chars = 3");
        assert!(mock_only.contains("providers.oa.chunk_chars is an option of the mock model"), "{mock_only}");
        assert_eq!(
            Settings::with_overrides("[providers.mock]\nkind = \"mock\"\nchunk_chars = 3").unwrap().providers["mock"]
                .mock()
                .chunk_chars,
            3
        );
    }

    #[test]
    fn a_value_none_of_the_choices_names_the_key_and_the_choices() {
        let refused = |toml: &str| Settings::with_overrides(toml).expect_err(toml).to_string();
        let kind = refused("[providers.vllm]\nkind = \"openai-compatible\"");
        assert!(
            kind.starts_with(
                "config: providers.vllm.kind = \"openai-compatible\" in TOML source string is not one of: \
                 anthropic, openai, google, openai_compatible, mock"
            ),
            "{kind}"
        );
        assert!(kind.ends_with("(did you mean \"openai_compatible\"?)"), "{kind}");
        assert!(!kind.contains("default.") && !kind.contains('`'), "no figment profile, no nested quotes: {kind}");
        let far = refused("[stream]\non_disconnect = \"zzzzzzzzzzzz\"");
        assert!(far.ends_with("is not one of: continue, cancel"), "{far}");
        let wrong_type = refused("[server]\nport = \"eighty\"");
        assert!(wrong_type.starts_with("config: server.port in TOML source string: "), "{wrong_type}");
        assert!(!wrong_type.contains("default."), "{wrong_type}");
    }

    #[test]
    fn an_approval_timeout_must_be_a_usable_number_of_seconds() {
        for bad in ["0", "-5", "nan", "inf", "1e13"] {
            let error = Settings::with_overrides(&format!("[tools]\napproval_timeout_secs = {bad}"))
                .expect_err(bad)
                .to_string();
            assert!(error.contains("tools.approval_timeout_secs"), "{bad}: {error}");
        }
        let settings = Settings::with_overrides("[tools]\napproval_timeout_secs = 30").unwrap();
        assert_eq!(settings.tools.approval_timeout_secs, 30.0);
    }

    #[test]
    fn a_provider_spreads_its_http2_calls_over_at_least_one_connection() {
        let provider = |extra: &str| format!("[providers.vllm]\nkind = \"openai_compatible\"\nhttp2 = true\n{extra}");
        let error = Settings::with_overrides(&provider("http2_connections = 0")).expect_err("0").to_string();
        assert!(error.contains("providers.vllm.http2_connections must be at least 1"), "{error}");
        assert_eq!(Settings::with_overrides(&provider("")).unwrap().providers["vllm"].http2_connections, 4);
    }

    #[test]
    fn no_profiles_means_the_mock_default() {
        let settings = Settings::with_overrides("").unwrap();
        let profile = &settings.profiles["default"];
        assert_eq!(settings.providers[&profile.provider].kind, ProviderKind::Mock);
    }

    #[test]
    fn the_mock_provider_stays_when_profiles_are_configured() {
        let settings = Settings::with_overrides(
            "[chat]\ndefault_profile = \"real\"\n[providers.oa]\nkind = \"openai\"\n\
             [profiles.real]\nprovider = \"oa\"\nmodel = \"gpt\"\n[profiles.try]\nprovider = \"mock\"\nmodel = \"m\"",
        )
        .unwrap();
        assert_eq!(settings.providers[MOCK_ID].kind, ProviderKind::Mock);
        assert_eq!(settings.profiles.keys().collect::<Vec<_>>(), ["real", "try"], "no default profile is added");
    }

    #[test]
    fn the_contract_example_loads() {
        let settings = Settings::with_overrides(
            r#"
            [providers.local]
            kind = "openai_compatible"
            base_url = "http://127.0.0.1:11434/v1"
            [providers.claude]
            kind = "anthropic"
            api_key_env = "CHATD_TEST_SURELY_UNSET_KEY"
            [profiles.default]
            provider = "local"
            model = "qwen3:0.6b"
            system_prompt = "You are a helpful assistant."
            max_iterations = 5
            context_limit = 32768
            tools = ["*"]
            [profiles.sonnet]
            provider = "claude"
            model = "claude-sonnet-4-5"
            enable_thinking = true
            thinking_budget = 4000
            "#,
        )
        .unwrap();
        assert_eq!(settings.profiles["sonnet"].thinking_budget, Some(4000));
        // The built-in mock stays beside configured providers (issue 21); no profile is added.
        assert_eq!(settings.providers[MOCK_ID].kind, ProviderKind::Mock);
        assert!(settings.profiles.values().all(|p| p.provider != MOCK_ID));
        assert!(settings.providers["claude"].api_key.is_none());
    }

    #[test]
    fn a_profile_with_an_unknown_provider_is_refused() {
        let err = Settings::with_overrides("[profiles.default]\nprovider = \"nope\"\nmodel = \"m\"").unwrap_err();
        assert!(err.to_string().contains("unknown provider 'nope'"), "{err}");
    }

    #[test]
    fn token_mode_needs_tokens() {
        let err = Settings::with_overrides("[auth]\nmode = \"token\"").unwrap_err();
        assert!(err.to_string().contains("auth.tokens"), "{err}");
    }

    #[test]
    fn negative_prices_and_budgets_are_refused_with_their_key() {
        let price = Settings::with_overrides("[pricing.\"m\"]\ninput_per_mtok = -1.0\noutput_per_mtok = 1.0\n");
        assert!(price.unwrap_err().to_string().contains("pricing.\"m\""));
        let budget = Settings::with_overrides("[limits.budgets.ann]\nusd_per_month = -5.0\n");
        assert!(budget.unwrap_err().to_string().contains("limits.budgets.ann.usd_per_month"));
        assert!(Settings::with_overrides("[limits]\nbudget_usd_per_month = 0.0\n").is_ok());
    }
}
