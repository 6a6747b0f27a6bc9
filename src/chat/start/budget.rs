//! Budgets (CONTRACT.md §18): what one user may spend, in tokens per UTC day and in US
//! dollars per calendar month. A start is refused (429 `QUOTA_EXCEEDED`, `Retry-After` until
//! the period resets) where its runs' reservations would pass a budget: each going run holds
//! what its next model call may spend (its request's estimate and its output allowance, and
//! their price) until it ends, so that a burst of starts cannot all pass on the same spend.
//! A user's starts take turns here; on a shared store the start checks again in its
//! transaction, under a lock per user, against every replica's runs. A run that passes a
//! budget while it runs ends after the model call it is in (`finish_reason: "budget"`).

use std::sync::Arc;
use std::time::Duration;

use super::turns::{Turn, Turns};
use crate::chat::errors::ChatError;
use crate::chat::run::agent::RunPlan;
use crate::chat::run::context;
use crate::config::Settings;
use crate::domain::{Usage, now};
use crate::ids::UserId;
use crate::pricing::Prices;
use crate::store::{BudgetHold, Budgets, Store};

/// What a run's next model call may write when its profile sets no `max_tokens`.
pub const OUTPUT_ALLOWANCE: u64 = 1024;

/// Checks starts against their users' budgets.
#[derive(Clone)]
pub(in crate::chat) struct Budgeter {
    settings: Arc<Settings>,
    store: Arc<dyn Store>,
    prices: Arc<Prices>,
    turns: Turns<UserId>,
}

impl Budgeter {
    pub(in crate::chat) fn new(shared: &crate::chat::shared::Shared) -> Self {
        Self {
            settings: shared.settings.clone(),
            store: shared.store.clone(),
            prices: shared.prices.clone(),
            turns: Turns::default(),
        }
    }

    /// What a start of `plans` holds of `user`'s budgets, and the user's turn, to keep until
    /// the start is written; `None` where no budget applies to the user.
    pub(in crate::chat) async fn hold(
        &self,
        user: &UserId,
        plans: &[RunPlan],
    ) -> Result<Option<(BudgetHold, Turn<UserId>)>, ChatError> {
        let Some(budgets) = Budgets::of(&self.settings, user.as_str(), now()) else { return Ok(None) };
        let turn = self.turns.take(user.clone()).await;
        // The largest of the start's runs (two for a comparison), for each.
        let (mut reserve_tokens, mut reserve_usd) = (0, 0.0_f64);
        for plan in plans {
            let (tokens, usd) = self.reservation(plan);
            reserve_tokens = reserve_tokens.max(tokens);
            reserve_usd = reserve_usd.max(usd);
        }
        let spend = self.store.spend(user, &budgets).await?;
        let runs = plans.len() as u64;
        let (more_tokens, more_usd) = (reserve_tokens * runs, reserve_usd * runs as f64);
        if budgets.passed_with(&spend, more_tokens, more_usd) {
            // Where both are passed, the month's resets later.
            let monthly = budgets.usd_per_month.is_some_and(|limit| spend.usd + spend.reserved_usd + more_usd > limit);
            return Err(over_budget(&budgets, monthly || budgets.tokens_per_day.is_none()));
        }
        Ok(Some((BudgetHold { budgets, reserve_tokens, reserve_usd }, turn)))
    }

    /// What a run's next model call may spend: its request as estimated, and what it may
    /// write; and its price where known (0 where not: a budget in dollars counts what has a
    /// price).
    fn reservation(&self, plan: &RunPlan) -> (u64, f64) {
        let input = context::request_tokens(&plan.request);
        let output = plan.request.max_tokens.map_or(OUTPUT_ALLOWANCE, u64::from);
        let usage = Usage { input_tokens: input, output_tokens: output, ..Usage::default() };
        let ttl = plan.request.prompt_cache.unwrap_or_default();
        let usd = self.prices.cost(&plan.provider_id, &plan.request.model, &usage, now(), ttl);
        (input + output, usd.unwrap_or(0.0))
    }
}

/// The 429 of a start past a budget (`monthly`: the month's in dollars, else the day's in
/// tokens), with the seconds until it resets.
pub(in crate::chat) fn over_budget(budgets: &Budgets, monthly: bool) -> ChatError {
    let (resets, message) = match (monthly, budgets.usd_per_month) {
        (true, Some(limit)) => {
            (budgets.next_month(), format!("The monthly budget of ${limit} is spent, or held by the answers going"))
        }
        _ => (
            budgets.next_day(),
            format!(
                "The daily budget of {} tokens is spent, or held by the answers going",
                budgets.tokens_per_day.unwrap_or(0)
            ),
        ),
    };
    let retry_after = (resets - now()).to_std().unwrap_or(Duration::from_secs(1)).max(Duration::from_secs(1));
    ChatError::QuotaExceeded { message, retry_after }
}
