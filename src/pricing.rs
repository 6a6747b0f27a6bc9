//! What a model call cost (CONTRACT.md §18): priced by the pydantic genai-prices table,
//! which ships in the binary (prices per provider and model, with their cache prices and
//! the dates they held), at the time of the call; `pricing.<model>` in config overrides the
//! table or adds a model it lacks. Where no price is known there is no cost: never 0.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::RwLock;

use chrono::{DateTime, Utc};
use genai_prices::{Calculator, ErrorKind, PriceRequest, UsageKey};

use crate::config::{CacheTtl, ModelPricing, ProviderKind, Settings};
use crate::domain::Usage;

/// The prices of the configured providers' models.
#[derive(Debug, Default)]
pub struct Prices {
    overrides: BTreeMap<String, ModelPricing>,
    /// How the table knows each configured provider (`providers.<id>`).
    providers: HashMap<String, Source>,
    /// The models of each provider that the table has no price for: the table is fixed, so
    /// a local model (Ollama, vLLM) is not searched for again at each run's end (its search,
    /// the table's patterns tried one by one, cost about as much as relaying a run's first
    /// ten tokens).
    unpriced: RwLock<HashMap<String, HashSet<String>>>,
}

/// At most this many unpriced models are remembered per provider (a request may name any).
const UNPRICED_KEPT: usize = 1024;

/// How a provider is found in the table: by its id there, by its API's address (an
/// OpenAI-compatible server such as OpenRouter), or not at all (the mock).
#[derive(Debug, Clone)]
enum Source {
    Id(&'static str),
    Url(String),
    Unpriced,
}

impl Prices {
    pub fn from_settings(settings: &Settings) -> Self {
        let providers = settings
            .providers
            .iter()
            .map(|(id, provider)| {
                let source = match provider.kind {
                    ProviderKind::Anthropic => Source::Id("anthropic"),
                    ProviderKind::Openai => Source::Id("openai"),
                    ProviderKind::Google => Source::Id("google"),
                    ProviderKind::OpenaiCompatible => provider.base_url.clone().map_or(Source::Unpriced, Source::Url),
                    ProviderKind::Mock => Source::Unpriced,
                };
                (id.clone(), source)
            })
            .collect();
        // The table is decoded on first use (tens of milliseconds): not on a run's path.
        let _ = Calculator::bundled();
        Self { overrides: settings.pricing.clone(), providers, unpriced: RwLock::default() }
    }

    /// What `usage` of `model`, asked of the provider `provider_id` at `at`, cost in US
    /// dollars; `None` where no price is known. Cache writes are priced at their TTL's rate:
    /// as the provider broke them down, else as the request asked (`ttl`).
    pub fn cost(&self, provider_id: &str, model: &str, usage: &Usage, at: DateTime<Utc>, ttl: CacheTtl) -> Option<f64> {
        if let Some(price) = self.overrides.get(model) {
            return Some(priced(price, usage));
        }
        let mut counts = genai_prices::Usage::from([
            (UsageKey::INPUT_TOKENS, usage.input_tokens as f64),
            (UsageKey::OUTPUT_TOKENS, usage.output_tokens as f64),
        ]);
        if let Some(read) = usage.cache_read_tokens {
            counts.insert(UsageKey::CACHE_READ_TOKENS, read as f64);
        }
        if let Some(written) = usage.cache_write_tokens {
            counts.insert(UsageKey::CACHE_WRITE_TOKENS, written as f64);
            let hour = match (usage.cache_write_1h_tokens, ttl) {
                (Some(hour), _) => hour.min(written),
                (None, CacheTtl::OneHour) => written,
                (None, CacheTtl::FiveMinutes) => 0,
            };
            if hour > 0 {
                counts.insert(UsageKey::CACHE_WRITE_1H_TOKENS, hour as f64);
            }
        }
        let request = PriceRequest::new(model, &counts).with_timestamp(std::time::SystemTime::from(at));
        let request = match self.providers.get(provider_id)? {
            Source::Id(id) => request.with_provider_id(id),
            Source::Url(url) => request.with_provider_api_url(url),
            Source::Unpriced => return None,
        };
        let known = |unpriced: &HashMap<String, HashSet<String>>| unpriced.get(provider_id)?.get(model).map(drop);
        if self.unpriced.read().ok().and_then(|unpriced| known(&unpriced)).is_some() {
            return None;
        }
        match Calculator::bundled().calculate(&request) {
            Ok(price) => Some(price.total_price),
            Err(e) => {
                tracing::debug!(model, provider = provider_id, error = %e, "no price for the model");
                // Not found stays not found; other errors (a usage it refuses) are the call's.
                if matches!(e.kind(), ErrorKind::ProviderNotFound | ErrorKind::ModelNotFound)
                    && let Ok(mut unpriced) = self.unpriced.write()
                {
                    let models = unpriced.entry(provider_id.to_owned()).or_default();
                    if models.len() < UNPRICED_KEPT {
                        models.insert(model.to_owned());
                    }
                }
                None
            }
        }
    }
}

/// `usage` at a configured price: the input read from or written to the cache at its own
/// rate (the input's where none is given), the rest of the input at the input's.
fn priced(price: &ModelPricing, usage: &Usage) -> f64 {
    let read = usage.cache_read_tokens.unwrap_or(0);
    let written = usage.cache_write_tokens.unwrap_or(0);
    let uncached = usage.input_tokens.saturating_sub(read + written);
    let per_token = |per_mtok: f64, tokens: u64| per_mtok * tokens as f64 / 1_000_000.0;
    per_token(price.input_per_mtok, uncached)
        + per_token(price.cache_read_per_mtok.unwrap_or(price.input_per_mtok), read)
        + per_token(price.cache_write_per_mtok.unwrap_or(price.input_per_mtok), written)
        + per_token(price.output_per_mtok, usage.output_tokens)
}

/// A run's cost: the sum of its model calls' where each is known; unknown (absent) once one
/// call that used tokens has no price, as a partial sum would pass for the whole.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct RunCost {
    /// The sum so far; `None` before the first call and after an unpriced one.
    pub usd: Option<f64>,
    /// Whether a call used tokens and had no price.
    pub unknown: bool,
}

impl RunCost {
    pub fn add(&mut self, call: Option<f64>, usage: &Usage) {
        match call {
            Some(usd) => self.usd = Some(self.usd.unwrap_or(0.0) + usd),
            None if usage.input_tokens + usage.output_tokens > 0 => self.unknown = true,
            None => {}
        }
    }

    /// What the run cost, where known.
    pub fn usd(&self) -> Option<f64> {
        self.usd.filter(|_| !self.unknown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prices(extra: &str) -> Prices {
        let settings = Settings::with_overrides(&format!(
            "[providers.claude]\nkind = \"anthropic\"\n\
             [providers.gpt]\nkind = \"openai\"\n\
             [providers.router]\nkind = \"openai_compatible\"\nbase_url = \"https://openrouter.ai/api/v1\"\n\
             [providers.local]\nkind = \"openai_compatible\"\nbase_url = \"http://127.0.0.1:11434/v1\"\n{extra}"
        ))
        .unwrap();
        Prices::from_settings(&settings)
    }

    fn usage(input: u64, output: u64, read: Option<u64>, written: Option<u64>) -> Usage {
        Usage {
            input_tokens: input,
            output_tokens: output,
            cache_read_tokens: read,
            cache_write_tokens: written,
            ..Usage::default()
        }
    }

    fn at(date: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(date).unwrap().with_timezone(&Utc)
    }

    /// The table's own price of `usage`, asked directly of it.
    fn table(provider: &str, model: &str, counts: &[(UsageKey, f64)], when: DateTime<Utc>) -> f64 {
        let counts = genai_prices::Usage::from_iter(counts.iter().cloned());
        let request = PriceRequest::new(model, &counts)
            .with_provider_id(provider)
            .with_timestamp(std::time::SystemTime::from(when));
        Calculator::bundled().calculate(&request).unwrap().total_price
    }

    #[test]
    fn cache_reads_and_writes_are_priced_at_the_tables_own_rates() {
        let prices = prices("");
        let when = at("2026-11-01T12:00:00Z");
        let model = "claude-sonnet-4-5";
        // 10,000 input tokens: 6,000 read from the cache, 3,000 written to it, 1,000 neither.
        let call = usage(10_000, 500, Some(6_000), Some(3_000));
        let cost = prices.cost("claude", model, &call, when, CacheTtl::FiveMinutes).unwrap();
        // Each rate per million, read off the table at 100,000 tokens (below its long-context
        // tier, where the rates change).
        let rate = |counts: &[(UsageKey, f64)]| table("anthropic", model, counts, when) * 10.0;
        let n = 100_000.0;
        let input = rate(&[(UsageKey::INPUT_TOKENS, n)]);
        let read = rate(&[(UsageKey::INPUT_TOKENS, n), (UsageKey::CACHE_READ_TOKENS, n)]);
        let write = rate(&[(UsageKey::INPUT_TOKENS, n), (UsageKey::CACHE_WRITE_TOKENS, n)]);
        let output = rate(&[(UsageKey::OUTPUT_TOKENS, n)]);
        // The table's rates: a read costs a tenth of the input, a write more than it.
        assert!(read < input / 5.0 && write > input, "{input} {read} {write}");
        let expected = (1_000.0 * input + 6_000.0 * read + 3_000.0 * write + 500.0 * output) / 1_000_000.0;
        assert!((cost - expected).abs() < 1e-9, "{cost} != {expected}");
        // The same tokens without a cache cost more.
        let plain = prices.cost("claude", model, &usage(10_000, 500, None, None), when, CacheTtl::FiveMinutes).unwrap();
        assert!(cost < plain + 3_000.0 * (write - input) / 1e6 + 1e-12 && plain > 0.0);
        // An hour's cache costs more to write than five minutes'.
        let long = prices.cost("claude", model, &call, when, CacheTtl::OneHour).unwrap();
        assert!(long > cost, "{long} <= {cost}");
        // Where the provider broke the writes down by TTL, its breakdown is priced: a third
        // kept an hour costs between the two.
        let split = Usage { cache_write_1h_tokens: Some(1_000), ..call };
        let mixed = prices.cost("claude", model, &split, when, CacheTtl::FiveMinutes).unwrap();
        assert!(cost < mixed && mixed < long, "{cost} {mixed} {long}");
        assert_eq!(
            prices.cost(
                "claude",
                model,
                &Usage { cache_write_1h_tokens: Some(3_000), ..call },
                when,
                CacheTtl::FiveMinutes
            ),
            Some(long)
        );
    }

    #[test]
    fn openai_and_compatible_servers_are_priced_and_unknown_models_are_not() {
        let prices = prices("");
        let when = at("2026-11-01T12:00:00Z");
        let call = usage(2_000, 100, Some(1_024), None);
        let gpt = prices.cost("gpt", "gpt-4o", &call, when, CacheTtl::FiveMinutes).unwrap();
        let expected = table(
            "openai",
            "gpt-4o",
            &[
                (UsageKey::INPUT_TOKENS, 2_000.0),
                (UsageKey::OUTPUT_TOKENS, 100.0),
                (UsageKey::CACHE_READ_TOKENS, 1_024.0),
            ],
            when,
        );
        assert!((gpt - expected).abs() < 1e-12 && gpt > 0.0);
        // OpenRouter is found by its address.
        assert!(prices.cost("router", "anthropic/claude-sonnet-4.5", &call, when, CacheTtl::FiveMinutes).is_some());
        // No price: a model nobody sells, a local server, the mock.
        assert_eq!(prices.cost("gpt", "no-such-model-x", &call, when, CacheTtl::FiveMinutes), None);
        assert_eq!(prices.cost("local", "llama3.2", &call, when, CacheTtl::FiveMinutes), None);
        assert_eq!(prices.cost("mock", "mock-1", &call, when, CacheTtl::FiveMinutes), None);
    }

    #[test]
    fn a_model_without_a_price_is_remembered_for_its_provider_only() {
        let prices = prices("");
        let when = at("2026-11-01T12:00:00Z");
        let call = usage(2_000, 100, None, None);
        let gpt = |model| prices.cost("gpt", model, &call, when, CacheTtl::FiveMinutes);
        for _ in 0..2 {
            assert_eq!(prices.cost("local", "gpt-4o", &call, when, CacheTtl::FiveMinutes), None);
            assert_eq!(gpt("no-such-model-x"), None);
        }
        let remembered = prices.unpriced.read().unwrap().clone();
        assert_eq!(remembered.get("local").map(|m| m.contains("gpt-4o")), Some(true));
        assert_eq!(remembered.get("gpt").map(|m| m.contains("no-such-model-x")), Some(true));
        // The name another provider had no price for is still priced where it is sold.
        assert!(gpt("gpt-4o").is_some_and(|cost| cost > 0.0));
        assert_eq!(remembered.get("gpt").map(|m| m.len()), Some(1));
    }

    #[test]
    fn a_configured_price_overrides_the_table_or_adds_a_model() {
        let prices = prices(
            "[pricing.\"llama3.2\"]\ninput_per_mtok = 1.0\noutput_per_mtok = 2.0\ncache_read_per_mtok = 0.5\n\
             [pricing.\"gpt-4o\"]\ninput_per_mtok = 10.0\noutput_per_mtok = 10.0\n",
        );
        let when = at("2026-11-01T12:00:00Z");
        let call = usage(3_000_000, 1_000_000, Some(1_000_000), Some(1_000_000));
        // 1M uncached at 1, 1M read at 0.5, 1M written at the input's 1, 1M out at 2.
        let local = prices.cost("local", "llama3.2", &call, when, CacheTtl::FiveMinutes).unwrap();
        assert!((local - 4.5).abs() < 1e-9, "{local}");
        let gpt = prices.cost("gpt", "gpt-4o", &usage(1_000_000, 0, None, None), when, CacheTtl::FiveMinutes);
        assert_eq!(gpt, Some(10.0));
    }

    #[test]
    fn a_runs_cost_is_unknown_once_a_call_had_no_price() {
        let mut cost = RunCost::default();
        assert_eq!(cost.usd(), None);
        cost.add(Some(0.25), &usage(10, 1, None, None));
        cost.add(None, &Usage::default());
        assert_eq!(cost.usd(), Some(0.25));
        cost.add(None, &usage(10, 1, None, None));
        assert_eq!(cost.usd(), None);
    }
}
